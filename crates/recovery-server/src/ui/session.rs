//! Who is looking at the console, and whether a form they sent is theirs.
//!
//! Invariants:
//! - a session cookie holds a random id (two v4 UUIDs, 244 random bits); the database holds only
//!   its SHA-256 with the token's name, role and expiry, never the token or the id;
//! - the cookie is `HttpOnly; SameSite=Strict; Path=/ui`, so a cross-site page never sends it;
//! - every state-changing form carries a CSRF token derived from the session id (or, on an
//!   unauthenticated loopback service, from a per-process secret) and is refused with 403 when
//!   it does not match, or when the browser says the request is cross-site;
//! - roles are the API's: each action calls the API's own handler with the session's caller.

use crate::config::{Caller, Role};
use crate::state::AppState;
use axum::extract::FromRequestParts;
use axum::http::request::Parts;
use axum::http::{HeaderMap, StatusCode, header};
use axum::response::{IntoResponse, Redirect, Response};
use sha2::{Digest, Sha256};

/// The cookie that carries the session id.
pub const COOKIE: &str = "rr_session";
/// How long a session lives.
pub const SESSION_HOURS: i64 = 12;

/// A console visitor: the caller the API sees, and the CSRF token their forms carry.
#[derive(Debug, Clone)]
pub struct Visitor {
    pub caller: Caller,
    pub csrf: String,
    /// The stored hash of the session (none on an unauthenticated service).
    pub session_hash: Option<String>,
    /// Whether there is anyone to sign out (a session, not the open loopback mode).
    pub signed_in: bool,
}

impl Visitor {
    pub fn is_operator(&self) -> bool {
        self.caller.role == Role::Operator
    }
}

fn sha256_hex(text: &str) -> String {
    recovery_core::canonical::hex(&Sha256::digest(text.as_bytes()))
}

/// The CSRF token of a session id: a hash only the holder of the id can compute.
fn csrf_of(session_id: &str) -> String {
    sha256_hex(&format!("rollout-recovery console csrf\n{session_id}"))
}

/// A per-process secret standing in for a session on an unauthenticated (loopback) service.
fn open_secret() -> &'static str {
    static SECRET: std::sync::OnceLock<String> = std::sync::OnceLock::new();
    SECRET.get_or_init(|| {
        format!(
            "{}{}",
            recovery_sidecar::new_id(),
            recovery_sidecar::new_id()
        )
    })
}

fn cookie_value(headers: &HeaderMap) -> Option<String> {
    headers
        .get_all(header::COOKIE)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(';'))
        .filter_map(|pair| pair.trim().split_once('='))
        .find(|(name, _)| *name == COOKIE)
        .map(|(_, value)| value.to_owned())
}

/// Why a page could not be shown to this visitor.
#[derive(Debug)]
pub enum Refusal {
    /// Not signed in: a page sends them to the sign-in form.
    SignIn,
    /// A form that is not theirs (or a cross-site request): 403.
    Forged(&'static str),
    /// The store failed.
    Internal,
}

impl IntoResponse for Refusal {
    fn into_response(self) -> Response {
        match self {
            Self::SignIn => Redirect::to("/ui/login").into_response(),
            Self::Forged(why) => super::pages::error_page(StatusCode::FORBIDDEN, why),
            Self::Internal => super::pages::error_page(
                StatusCode::INTERNAL_SERVER_ERROR,
                "the service failed; see its log",
            ),
        }
    }
}

impl FromRequestParts<AppState> for Visitor {
    type Rejection = Refusal;

    async fn from_request_parts(parts: &mut Parts, state: &AppState) -> Result<Self, Refusal> {
        if state.config.tokens.is_empty() {
            return Ok(Self {
                caller: state
                    .config
                    .authenticate(None)
                    .map_err(|_| Refusal::Internal)?,
                csrf: csrf_of(open_secret()),
                session_hash: None,
                signed_in: false,
            });
        }
        // A page without a session sends the visitor to sign in; a form without one is refused
        // (a cross-site form never carries the SameSite=Strict cookie).
        let missing = if parts.method == axum::http::Method::GET {
            Refusal::SignIn
        } else {
            Refusal::Forged("sign in first: this form has no session")
        };
        let Some(id) = cookie_value(&parts.headers) else {
            return Err(missing);
        };
        let hash = sha256_hex(&id);
        let now = state.registry.clock().now_text();
        let session = state
            .registry
            .store()
            .live_session(&hash, &now)
            .await
            .map_err(|_| Refusal::Internal)?;
        let Some(session) = session else {
            return Err(missing);
        };
        let Some(role) = Role::parse(&session.role) else {
            return Err(missing);
        };
        // A session lasts only while the token that opened it is configured, under the same
        // name and role: a token removed or rotated (and the service restarted) signs its
        // sessions out.
        let opened_by = |token: &crate::config::TokenEntry| {
            token.name == session.name
                && token.role == role
                && session.token_fingerprint.as_deref() == Some(token.fingerprint().as_str())
        };
        if !state.config.tokens.iter().any(opened_by) {
            return Err(missing);
        }
        Ok(Self {
            caller: Caller {
                name: session.name,
                role,
            },
            csrf: csrf_of(&id),
            session_hash: Some(hash),
            signed_in: true,
        })
    }
}

/// Refuses a state-changing request the browser marks cross-site, or whose `Origin` is not
/// this service (a forged form on another site), before any form is read.
pub fn same_origin(headers: &HeaderMap) -> Result<(), Refusal> {
    let fetch_site = headers.get("sec-fetch-site").and_then(|v| v.to_str().ok());
    if matches!(fetch_site, Some("cross-site" | "same-site")) {
        return Err(Refusal::Forged(
            "a cross-site request cannot change anything here",
        ));
    }
    let host = headers.get(header::HOST).and_then(|v| v.to_str().ok());
    let origin = headers.get(header::ORIGIN).and_then(|v| v.to_str().ok());
    match (origin, host) {
        (None, _) => Ok(()),
        (Some(origin), Some(host))
            if origin
                .split_once("://")
                .is_some_and(|(_, rest)| rest == host) =>
        {
            Ok(())
        }
        _ => Err(Refusal::Forged(
            "a request from another origin cannot change anything here",
        )),
    }
}

/// Checks a form's CSRF token (and its origin) against the visitor's.
pub fn check_form(visitor: &Visitor, headers: &HeaderMap, token: &str) -> Result<(), Refusal> {
    same_origin(headers)?;
    // Both are hex digests of one length: compare without stopping at the first difference.
    let matches = token.len() == visitor.csrf.len()
        && token
            .bytes()
            .zip(visitor.csrf.bytes())
            .fold(0u8, |acc, (a, b)| acc | (a ^ b))
            == 0;
    if matches {
        Ok(())
    } else {
        Err(Refusal::Forged(
            "this form is not from your session (reload the page and try again)",
        ))
    }
}

/// Starts a session for the caller a token names: the cookie to set. `token_fingerprint`
/// ties it to that token ([`crate::config::TokenEntry::fingerprint`]).
pub async fn start(
    state: &AppState,
    caller: &Caller,
    token_fingerprint: String,
) -> Result<String, Refusal> {
    let id = format!(
        "{}{}",
        recovery_sidecar::new_id(),
        recovery_sidecar::new_id()
    );
    let now = state.registry.clock().now();
    let session = recovery_store::ConsoleSession {
        session_hash: sha256_hex(&id),
        name: caller.name.clone(),
        role: caller.role.label().to_owned(),
        created_at: state.registry.clock().now_text(),
        expires_at: recovery_sidecar::format_rfc3339(now + time::Duration::hours(SESSION_HOURS)),
        token_fingerprint: Some(token_fingerprint),
    };
    state
        .registry
        .store()
        .insert_session(&session)
        .await
        .map_err(|_| Refusal::Internal)?;
    Ok(format!(
        "{COOKIE}={id}; HttpOnly; SameSite=Strict; Path=/ui; Max-Age={}",
        SESSION_HOURS * 3600
    ))
}

/// Ends the visitor's session: the cookie that clears it.
pub async fn end(state: &AppState, visitor: &Visitor) -> String {
    if let Some(hash) = &visitor.session_hash {
        let now = state.registry.clock().now_text();
        if let Err(e) = state.registry.store().end_session(hash, &now).await {
            tracing::warn!(error = %e, "ending a console session failed");
        }
    }
    format!("{COOKIE}=; HttpOnly; SameSite=Strict; Path=/ui; Max-Age=0")
}
