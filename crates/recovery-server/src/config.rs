//! Service configuration and bearer-token authentication.
//!
//! Invariants: tokens are kept only as SHA-256 digests (a token value never sits in memory longer
//! than the parse, and is never logged); without tokens the service runs unauthenticated only when
//! bound to a loopback address; roles are `viewer` (read), `collector` (run its collections) and
//! `operator` (everything, including approvals and takeovers).

use axum::extract::FromRequestParts;
use axum::http::request::Parts;
use recovery_core::drift::DriftPolicy;
use sha2::{Digest, Sha256};
use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use crate::error::{ApiError, ErrorCode};

/// What a caller may do.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Role {
    Viewer,
    Collector,
    Operator,
}

impl Role {
    /// The role's name as tokens spell it.
    pub fn label(self) -> &'static str {
        match self {
            Self::Viewer => "viewer",
            Self::Collector => "collector",
            Self::Operator => "operator",
        }
    }

    pub fn parse(text: &str) -> Option<Self> {
        match text {
            "viewer" => Some(Self::Viewer),
            "collector" => Some(Self::Collector),
            "operator" => Some(Self::Operator),
            _ => None,
        }
    }
}

/// One configured token: its role, a name for logs and audit, and its digest.
#[derive(Clone)]
pub struct TokenEntry {
    pub role: Role,
    pub name: String,
    digest: [u8; 32],
}

impl std::fmt::Debug for TokenEntry {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TokenEntry")
            .field("role", &self.role)
            .field("name", &self.name)
            .finish_non_exhaustive()
    }
}

impl TokenEntry {
    /// What a console session keeps of the token that opened it: a domain-separated SHA-256 of
    /// the token's SHA-256, never the token.
    pub fn fingerprint(&self) -> String {
        let mut hasher = Sha256::new();
        hasher.update(b"rollout-recovery console session token\n");
        hasher.update(self.digest);
        recovery_core::canonical::hex(&hasher.finalize())
    }

    /// The configured entry of a presented bearer token.
    pub fn of_token<'a>(tokens: &'a [TokenEntry], token: &str) -> Option<&'a TokenEntry> {
        let digest: [u8; 32] = Sha256::digest(token.trim().as_bytes()).into();
        tokens.iter().find(|t| t.digest == digest)
    }

    /// Parses `role:name:token`.
    pub fn parse(spec: &str) -> Result<Self, String> {
        let mut parts = spec.splitn(3, ':');
        let (Some(role), Some(name), Some(token)) = (parts.next(), parts.next(), parts.next())
        else {
            return Err("a token is given as role:name:token".into());
        };
        let role = Role::parse(role)
            .ok_or_else(|| format!("unknown role {role:?} (viewer, collector, operator)"))?;
        if name.is_empty() || token.len() < 16 {
            return Err(format!(
                "token {name:?}: a name and a token of at least 16 characters are required"
            ));
        }
        if token.chars().any(|c| c.is_whitespace() || c.is_control()) {
            // A bearer token is sent trimmed: one with a space could never be presented whole.
            return Err(format!(
                "token {name:?}: a token holds no spaces or control characters"
            ));
        }
        if name
            .chars()
            .any(|c| c.is_whitespace() || c.is_control() || crate::limits::is_invisible_format(c))
        {
            return Err(format!(
                "token {name:?}: a name holds no spaces, control or invisible characters"
            ));
        }
        Ok(Self {
            role,
            name: name.to_owned(),
            digest: Sha256::digest(token.as_bytes()).into(),
        })
    }
}

/// How the service runs.
#[derive(Debug, Clone)]
pub struct ServerConfig {
    pub bind: SocketAddr,
    pub data_dir: PathBuf,
    /// `sqlite://...` or `postgres://...`; default: SQLite in the data directory.
    pub database_url: Option<String>,
    /// Output paths must lie under these.
    pub roots: Vec<PathBuf>,
    pub tokens: Vec<TokenEntry>,
    pub body_limit_bytes: usize,
    pub request_timeout: Duration,
    /// The attempt cap saved in new manifests (and used for manifests that saved none).
    pub default_max_attempts: u64,
    pub default_lease_ttl: Duration,
    pub max_lease_ttl: Duration,
    pub sweep_interval: Duration,
    pub drift_policy: DriftPolicy,
    /// This process's name among replicas.
    pub replica: String,
}

impl ServerConfig {
    /// Defaults for a data directory: loopback, SQLite inside it, outputs under `<data>/runs`.
    pub fn local(data_dir: PathBuf) -> Self {
        Self {
            bind: SocketAddr::from(([127, 0, 0, 1], 8787)),
            roots: vec![data_dir.join("runs")],
            data_dir,
            database_url: None,
            tokens: Vec::new(),
            body_limit_bytes: 64 * 1024 * 1024,
            request_timeout: Duration::from_secs(120),
            default_max_attempts: 3,
            default_lease_ttl: Duration::from_secs(60),
            max_lease_ttl: Duration::from_secs(3600),
            // Among replicas a lease ended elsewhere is let go at this replica's next sweep,
            // and others wait for that (`recovery_runs::leases::HANDOFF_WAIT`).
            sweep_interval: Duration::from_secs(1),
            drift_policy: DriftPolicy::default(),
            replica: format!("{}-{}", hostname(), std::process::id()),
        }
    }

    pub fn database_url(&self) -> String {
        self.database_url.clone().unwrap_or_else(|| {
            format!(
                "sqlite://{}",
                self.data_dir.join("rollout-recovery.db").display()
            )
        })
    }

    /// Refuses an unauthenticated service reachable beyond loopback, and settings that would
    /// make it refuse everything or nothing.
    pub fn check(&self) -> Result<(), String> {
        for (n, token) in self.tokens.iter().enumerate() {
            if self.tokens[..n].iter().any(|t| t.digest == token.digest) {
                return Err(format!(
                    "token {:?}: the same token is configured twice; each token names one caller and one role",
                    token.name
                ));
            }
        }
        if self.body_limit_bytes == 0 {
            return Err("--body-limit-mb (RR_BODY_LIMIT_MB) must be at least 1".into());
        }
        if self.request_timeout.is_zero() {
            return Err(
                "--request-timeout-secs (RR_REQUEST_TIMEOUT_SECS) must be at least 1".into(),
            );
        }
        if self.tokens.is_empty() && !self.bind.ip().is_loopback() {
            return Err(format!(
                "refusing to serve {} without tokens: configure --token role:name:token (RR_TOKENS) or bind to 127.0.0.1",
                self.bind
            ));
        }
        if self.default_lease_ttl.is_zero() || self.default_lease_ttl > self.max_lease_ttl {
            return Err(format!(
                "--lease-ttl-secs (RR_LEASE_TTL_SECS) must be between 1 and {}",
                self.max_lease_ttl.as_secs()
            ));
        }
        if !(1..=crate::limits::MAX_ROLLOUT_ATTEMPTS).contains(&self.default_max_attempts) {
            return Err(format!(
                "--max-rollout-attempts (RR_MAX_ROLLOUT_ATTEMPTS) must be between 1 and {}",
                crate::limits::MAX_ROLLOUT_ATTEMPTS
            ));
        }
        Ok(())
    }

    /// The caller a bearer token names, or the local operator in unauthenticated mode.
    pub fn authenticate(&self, authorization: Option<&str>) -> Result<Caller, ApiError> {
        if self.tokens.is_empty() {
            return Ok(Caller {
                name: "local".into(),
                role: Role::Operator,
            });
        }
        let token = authorization
            .and_then(|h| h.split_once(' '))
            .filter(|(scheme, _)| scheme.eq_ignore_ascii_case("bearer"))
            .map(|(_, token)| token.trim())
            .ok_or_else(|| {
                ApiError::new(
                    ErrorCode::Unauthenticated,
                    "an Authorization: Bearer <token> header is required",
                )
            })?;
        let digest: [u8; 32] = Sha256::digest(token.trim().as_bytes()).into();
        self.tokens
            .iter()
            .find(|t| t.digest == digest)
            .map(|t| Caller {
                name: t.name.clone(),
                role: t.role,
            })
            .ok_or_else(|| {
                ApiError::new(ErrorCode::Unauthenticated, "the bearer token is not known")
            })
    }
}

fn hostname() -> String {
    std::fs::read_to_string("/etc/hostname")
        .map(|h| h.trim().to_owned())
        .unwrap_or_else(|_| "localhost".into())
}

/// An authenticated caller.
#[derive(Debug, Clone)]
pub struct Caller {
    pub name: String,
    pub role: Role,
}

impl Caller {
    /// Refuses callers below `role` (operators may do everything).
    pub fn require(&self, role: Role) -> Result<(), ApiError> {
        let allowed = match role {
            Role::Viewer => true,
            Role::Collector => matches!(self.role, Role::Collector | Role::Operator),
            Role::Operator => self.role == Role::Operator,
        };
        if allowed {
            Ok(())
        } else {
            Err(ApiError::new(
                ErrorCode::Forbidden,
                format!(
                    "this needs the {} role; {} is a {}",
                    role.label(),
                    self.name,
                    self.role.label()
                ),
            ))
        }
    }
}

/// Extractors of a caller allowed a role, checked with the caller's credentials, before the
/// request's body is read: a caller who may not make a call never has its body parsed (up to
/// the body limit) nor learns what is wrong with it (a viewer's malformed `POST /runs` is 403,
/// as its well-formed one is).
macro_rules! caller_with_role {
    ($name:ident, $role:expr) => {
        #[doc = concat!("A caller allowed the `", stringify!($role), "` role, checked before the body is read.")]
        #[derive(Debug, Clone)]
        pub struct $name(pub Caller);

        impl $name {
            /// `caller`, refused when it does not have the role (for callers that did not come
            /// through an extractor: the console's forms).
            pub fn checked(caller: Caller) -> Result<Self, ApiError> {
                caller.require($role)?;
                Ok(Self(caller))
            }
        }

        impl FromRequestParts<crate::state::AppState> for $name {
            type Rejection = ApiError;

            async fn from_request_parts(
                parts: &mut Parts,
                state: &crate::state::AppState,
            ) -> Result<Self, Self::Rejection> {
                Self::checked(Caller::from_request_parts(parts, state).await?)
            }
        }
    };
}

caller_with_role!(CollectorCaller, Role::Collector);
caller_with_role!(OperatorCaller, Role::Operator);

impl FromRequestParts<crate::state::AppState> for Caller {
    type Rejection = ApiError;

    async fn from_request_parts(
        parts: &mut Parts,
        state: &crate::state::AppState,
    ) -> Result<Self, Self::Rejection> {
        let header = parts
            .headers
            .get(axum::http::header::AUTHORIZATION)
            .and_then(|v| v.to_str().ok());
        state.config.authenticate(header)
    }
}
