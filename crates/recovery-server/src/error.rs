//! The one API error shape `{code, message, details}` and its closed table of codes.
//!
//! Invariants: every error response carries a stable `code` from [`ErrorCode`] (the OpenAPI spec
//! lists them); a message names the field or resource at fault; server-side failures are logged
//! once, here, and answered without internal detail; no credential value ever appears (messages are
//! built from names, paths and digests only).

use axum::Json;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use serde::Serialize;
use utoipa::ToSchema;

/// Stable error codes, one HTTP status each.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, ToSchema)]
#[serde(rename_all = "snake_case")]
pub enum ErrorCode {
    /// The request body or a parameter is malformed or missing a field.
    InvalidRequest,
    /// A cursor into a history that is no longer the one it was issued for (the database was
    /// made again, or restored from an older backup): start again without a cursor.
    CursorExpired,
    /// The bearer token is missing or unknown.
    Unauthenticated,
    /// The caller's role may not do this.
    Forbidden,
    /// No such run, approval, lease or re-judgment.
    NotFound,
    /// The output path is outside the allowed roots or unusable.
    PathRefused,
    /// A run already has a manifest at this output (resume with validate instead).
    RunExists,
    /// The run's output was taken over by another run (`details.superseded_by`).
    RunSuperseded,
    /// The saved identity does not verify against the current run.
    ResumeRefused,
    /// The saved run has no manifest.
    NoManifest,
    /// The saved manifest or materialized inputs cannot be read.
    ManifestUnreadable,
    /// The configuration has no identity (missing server, interpolation error).
    IdentityError,
    /// Saved rows cannot be planned or classified (malformed line, inconsistent record).
    RowsInvalid,
    /// A line a collector is about to save would be refused by the plan's rules (facts §11.2):
    /// `details.reason` names the rule, `details.field` is `line`. Nothing was written.
    OutcomeRefused,
    /// The run's files contradict its manifest: a companion it needs is missing, the
    /// materialized inputs do not match it, or an older collector's draft journal is beside it.
    RunFilesInvalid,
    /// Another client holds the run's lease, or another process its lock.
    RunLocked,
    /// The lease presented does not hold the run.
    LeaseNotHeld,
    /// The attempt is not eligible for a masked rerun approval, or a rollout for a new
    /// execution number (the plan does not run it again).
    NotEligible,
    /// The approval was used or revoked already, or a re-judgment closed.
    Conflict,
    /// The route exists, but not with this method.
    MethodNotAllowed,
    /// The request body exceeds the configured limit.
    PayloadTooLarge,
    /// The request target (path and query) is longer than the service reads.
    UriTooLong,
    /// The request's headers are larger than the service reads.
    HeadersTooLarge,
    /// The request took longer than the service's request timeout (RR_REQUEST_TIMEOUT_SECS).
    RequestTimeout,
    /// Too much heavy work (hashing, planning, classifying) is queued: retry after the
    /// `Retry-After` seconds.
    Overloaded,
    /// The service is starting: it reindexes the sidecars under its roots before it answers
    /// anything but `/healthz`, `/metrics` and `/openapi.json`; retry after the `Retry-After`
    /// seconds (`/readyz` answers 200 once it is ready).
    Starting,
    /// The service failed; nothing was half-written.
    Internal,
}

impl ErrorCode {
    /// The outcome a validate refused with this code is recorded as (and the offline
    /// `validate` prints): a refusal of the resume itself, the run held or superseded, `error`
    /// when the service failed, or `invalid` for a request that could not be decided at all.
    pub fn resume_outcome(self) -> &'static str {
        match self {
            Self::ResumeRefused => "refused",
            Self::NoManifest => "no_manifest",
            Self::ManifestUnreadable => "unreadable",
            Self::RunLocked => "locked",
            Self::LeaseNotHeld => "lease_not_held",
            Self::RunSuperseded => "superseded",
            // The service failed or was saturated: nothing was wrong with the request.
            Self::Internal | Self::Overloaded | Self::Starting | Self::RequestTimeout => "error",
            _ => "invalid",
        }
    }

    pub fn status(self) -> StatusCode {
        match self {
            Self::InvalidRequest
            | Self::IdentityError
            | Self::RowsInvalid
            | Self::OutcomeRefused
            | Self::PathRefused
            | Self::ManifestUnreadable => StatusCode::UNPROCESSABLE_ENTITY,
            Self::CursorExpired => StatusCode::GONE,
            Self::Unauthenticated => StatusCode::UNAUTHORIZED,
            Self::Forbidden => StatusCode::FORBIDDEN,
            Self::NotFound => StatusCode::NOT_FOUND,
            Self::RunExists
            | Self::RunSuperseded
            | Self::ResumeRefused
            | Self::NoManifest
            | Self::RunFilesInvalid
            | Self::NotEligible
            | Self::Conflict => StatusCode::CONFLICT,
            Self::RunLocked => StatusCode::LOCKED,
            Self::LeaseNotHeld => StatusCode::CONFLICT,
            Self::PayloadTooLarge => StatusCode::PAYLOAD_TOO_LARGE,
            Self::UriTooLong => StatusCode::URI_TOO_LONG,
            Self::HeadersTooLarge => StatusCode::REQUEST_HEADER_FIELDS_TOO_LARGE,
            Self::RequestTimeout => StatusCode::REQUEST_TIMEOUT,
            Self::MethodNotAllowed => StatusCode::METHOD_NOT_ALLOWED,
            Self::Overloaded | Self::Starting => StatusCode::SERVICE_UNAVAILABLE,
            Self::Internal => StatusCode::INTERNAL_SERVER_ERROR,
        }
    }
}

/// The error body of every endpoint.
#[derive(Debug, Clone, Serialize, ToSchema)]
pub struct ApiErrorBody {
    pub code: ErrorCode,
    pub message: String,
    /// Structured context (mismatch codes, keys, the lease holder...).
    #[schema(value_type = Object)]
    pub details: serde_json::Value,
}

/// An error answered to a client.
#[derive(Debug, Clone)]
pub struct ApiError {
    pub code: ErrorCode,
    pub message: String,
    pub details: serde_json::Value,
}

impl ApiError {
    pub fn new(code: ErrorCode, message: impl Into<String>) -> Self {
        Self {
            code,
            message: message.into(),
            details: serde_json::Value::Object(Default::default()),
        }
    }

    pub fn with_details(mut self, details: serde_json::Value) -> Self {
        self.details = details;
        self
    }

    pub fn invalid(message: impl Into<String>) -> Self {
        Self::new(ErrorCode::InvalidRequest, message)
    }

    /// An `invalid_request` about one field, named in the message and as `details.field` (a
    /// body field's path, such as `rows[3]`, or a query parameter) for clients to act on.
    pub fn invalid_field(field: &str, message: impl Into<String>) -> Self {
        Self::invalid(message).with_details(serde_json::json!({ "field": field }))
    }

    /// `lease_not_held` for the `lease_id` a caller presented: its lease ended (expired,
    /// released, taken over) or never held the run; the caller must not go on under it.
    pub fn lease_not_held(message: impl Into<String>) -> Self {
        Self::new(ErrorCode::LeaseNotHeld, message)
            .with_details(serde_json::json!({ "field": "lease_id" }))
    }

    /// [`Self::lease_not_held`] with the run's usual message.
    pub fn lease_not_held_on(run_id: &str) -> Self {
        Self::lease_not_held(format!(
            "lease_id: the lease presented does not hold run {run_id} (expired, released or taken over)"
        ))
    }

    pub fn not_found(message: impl Into<String>) -> Self {
        Self::new(ErrorCode::NotFound, message)
    }

    /// A server-side failure: logged here with its cause, answered without internal detail.
    pub fn internal(context: &str, cause: impl std::fmt::Display) -> Self {
        tracing::error!(context, error = %cause, "request failed");
        Self::new(
            ErrorCode::Internal,
            format!(
                "{context} failed; retry, or see the service log (what reached the run's files stands and is reindexed)"
            ),
        )
    }
}

impl IntoResponse for ApiError {
    fn into_response(mut self) -> Response {
        // A refusal whose message names a request field first (`source_path: ...`) names it
        // for programs too, whichever code it has (path and identity refusals are built in
        // many places; one rule here covers them all).
        if let Some(details) = self.details.as_object_mut() {
            if !details.contains_key("field") && self.code != ErrorCode::Internal {
                if let Some(field) = recovery_runs::operations::field_named_in(&self.message) {
                    details.insert("field".into(), field.into());
                }
            }
        }
        let status = self.code.status();
        let code = serde_json::to_value(self.code)
            .ok()
            .and_then(|v| v.as_str().map(str::to_owned))
            .unwrap_or_default();
        metrics::counter!("rollout_recovery_errors_total", "code" => code).increment(1);
        let retry_after = matches!(self.code, ErrorCode::Overloaded | ErrorCode::Starting)
            .then_some([(axum::http::header::RETRY_AFTER, "1")]);
        (
            status,
            retry_after,
            Json(ApiErrorBody {
                code: self.code,
                message: self.message,
                details: self.details,
            }),
        )
            .into_response()
    }
}

impl ApiError {
    /// A run whose output another run owns now.
    pub fn superseded(run_id: &str, by: &str) -> Self {
        Self::new(
            ErrorCode::RunSuperseded,
            format!("run {run_id} was superseded by run {by}, which owns its output now"),
        )
        .with_details(serde_json::json!({"superseded_by": by}))
    }
}

impl From<recovery_store::StoreError> for ApiError {
    fn from(error: recovery_store::StoreError) -> Self {
        Self::internal("the database", error)
    }
}

impl From<recovery_runs::RegistryError> for ApiError {
    fn from(error: recovery_runs::RegistryError) -> Self {
        match error {
            recovery_runs::RegistryError::Path(e) => {
                Self::new(ErrorCode::PathRefused, e.to_string())
            }
            recovery_runs::RegistryError::Lock(e) => e.into(),
            other => Self::internal("recording the run", other),
        }
    }
}

impl From<recovery_runs::RunFilesError> for ApiError {
    fn from(error: recovery_runs::RunFilesError) -> Self {
        use recovery_runs::RunFilesError;
        match error {
            RunFilesError::NoManifest(m) => Self::new(ErrorCode::NoManifest, m),
            RunFilesError::ManifestUnreadable(m) => Self::new(ErrorCode::ManifestUnreadable, m),
            RunFilesError::RowsInvalid(m) => Self::new(ErrorCode::RowsInvalid, m),
            RunFilesError::Inconsistent(m) => Self::new(ErrorCode::RunFilesInvalid, m),
            io @ RunFilesError::Io { .. } => Self::internal("reading the run's files", io),
        }
    }
}

/// Why a differing key refuses a resume (or that it does not), as `details.semantic_keys[].reason`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, ToSchema)]
#[serde(rename_all = "snake_case")]
pub enum KeyReason {
    /// A segment is a listed semantic key (or contains `dataset`).
    ListedKey,
    /// A segment names a prompt, template or rubric asset path.
    AssetPath,
    /// The last segment names a path of what a run reads (`model_path`, `data_dir`, ...).
    ReadPath,
    /// An operator declared the whole key semantic.
    DeclaredKey,
    /// A segment contains a semantic part (`judge`, `model`, ...).
    SemanticPart,
    /// No rule classifies the key: an unknown change refuses.
    Unclassified,
    /// The key is operational (resumes, journalled).
    Operational,
}

/// One differing key of a refused resume.
#[derive(Debug, Clone, Serialize, ToSchema)]
pub struct KeyView {
    pub key: String,
    /// `semantic` or `operational`.
    pub class: &'static str,
    pub reason: KeyReason,
    /// The segment (or declared key) the rule matched.
    pub segment: Option<String>,
}

/// `details` of a `resume_refused` answer.
#[derive(Debug, Clone, Serialize, ToSchema)]
pub struct ResumeRefusedDetails {
    /// Mismatch codes (`config_digest`, `source_digest`, ...).
    pub mismatches: Vec<&'static str>,
    pub semantic_keys: Vec<KeyView>,
}

/// One differing key as refusals list it (the service's answers and the offline `validate`).
pub fn key_view(key: &recovery_core::drift::ClassifiedKey) -> KeyView {
    use recovery_core::drift::{KeyClass, SemanticReason as R};
    let (class, reason, segment) = match &key.class {
        KeyClass::Operational => ("operational", KeyReason::Operational, None),
        KeyClass::Semantic(reason) => {
            let (code, segment) = match reason {
                R::ListedKey(s) => (KeyReason::ListedKey, Some(s)),
                R::AssetPath(s) => (KeyReason::AssetPath, Some(s)),
                R::ReadPath(s) => (KeyReason::ReadPath, Some(s)),
                R::DeclaredKey(s) => (KeyReason::DeclaredKey, Some(s)),
                R::SemanticPart(s) => (KeyReason::SemanticPart, Some(s)),
                R::Unclassified => (KeyReason::Unclassified, None),
            };
            ("semantic", code, segment.cloned())
        }
    };
    KeyView {
        key: key.key.clone(),
        class,
        reason,
        segment,
    }
}

/// The semantic keys and mismatch codes of a refused resume.
pub fn mismatch_details(mismatches: &[recovery_core::verdict::Mismatch]) -> serde_json::Value {
    use recovery_core::verdict::Mismatch;
    let semantic_keys = mismatches
        .iter()
        .filter_map(|m| match m {
            Mismatch::SemanticConfiguration(keys) => Some(keys),
            _ => None,
        })
        .flatten()
        .map(key_view)
        .collect();
    let details = ResumeRefusedDetails {
        mismatches: mismatches.iter().map(Mismatch::code).collect(),
        semantic_keys,
    };
    serde_json::to_value(details).unwrap_or_default()
}

impl From<recovery_runs::OpError> for ApiError {
    fn from(error: recovery_runs::OpError) -> Self {
        use recovery_runs::OpError;
        if let Some(field) = error.field() {
            return Self::invalid_field(field, error.to_string());
        }
        match error {
            OpError::Invalid(m) | OpError::SourceUnreadable(m) => Self::invalid(m),
            OpError::NotFound(m) => Self::not_found(m),
            OpError::NotEligible { message, details } => {
                Self::new(ErrorCode::NotEligible, message).with_details(details)
            }
            OpError::Conflict(m) => Self::new(ErrorCode::Conflict, m),
            OpError::LeaseNotHeld(m) => Self::lease_not_held(format!("lease_id: {m}")),
            OpError::Leased(lease) => Self::new(
                ErrorCode::RunLocked,
                format!("run {} is held by {}", lease.run_id, lease.holder),
            )
            .with_details(serde_json::json!({"holder": lease_holder(&lease)})),
            OpError::RunExists { message, run_id } => Self::new(ErrorCode::RunExists, message)
                .with_details(serde_json::json!({"run_id": run_id})),
            OpError::Superseded { run_id, by } => Self::superseded(&run_id, &by),
            OpError::PathRefused(m) => Self::new(ErrorCode::PathRefused, m),
            OpError::Identity(e) => Self::new(ErrorCode::IdentityError, e.to_string())
                .with_details(serde_json::json!({"kind": e.kind()})),
            OpError::ResumeRefused {
                message,
                mismatches,
            } => Self::new(ErrorCode::ResumeRefused, message)
                .with_details(mismatch_details(&mismatches)),
            OpError::Files(e) => e.into(),
            OpError::Registry(e) => e.into(),
            OpError::Store(e) => e.into(),
            OpError::Lease(e) => e.into(),
            failed @ (OpError::Join(_) | OpError::Invariant(_)) => {
                Self::internal("a run operation", failed)
            }
        }
    }
}

impl From<recovery_runs::RunLockError> for ApiError {
    fn from(error: recovery_runs::RunLockError) -> Self {
        match error {
            recovery_runs::RunLockError::Locked(e) => lock_error(e),
            other => Self::internal("locking the run", other),
        }
    }
}

impl From<recovery_runs::LeaseError> for ApiError {
    fn from(error: recovery_runs::LeaseError) -> Self {
        use recovery_runs::LeaseError;
        match error {
            LeaseError::Held(lease) => Self::new(
                ErrorCode::RunLocked,
                format!("run {} is held by {}", lease.run_id, lease.holder),
            )
            .with_details(serde_json::json!({"holder": lease_holder(&lease)})),
            LeaseError::CheckpointInUse { ref lease, .. } => {
                let holder = lease_holder(lease);
                Self::new(ErrorCode::RunLocked, error.to_string())
                    .with_details(serde_json::json!({"field": "checkpoint_dir", "holder": holder}))
            }
            LeaseError::CheckpointLocked { .. } => {
                Self::new(ErrorCode::RunLocked, error.to_string())
                    .with_details(serde_json::json!({"field": "checkpoint_dir"}))
            }
            LeaseError::Locked(e) => lock_error(e),
            LeaseError::NotHolder { .. } => Self::lease_not_held(format!("lease_id: {error}")),
            LeaseError::Store(e) => e.into(),
            LeaseError::Join(_) => Self::internal("the lease", error),
            LeaseError::Superseded {
                ref run_id,
                ref successor,
            } => Self::superseded(run_id, successor),
        }
    }
}

/// Another process holding the `flock` is `run_locked` (a client waits and retries); a lock
/// file that cannot be opened at all is the service's failure, never a lock to wait for.
fn lock_error(error: recovery_sidecar::LockError) -> ApiError {
    match error {
        owned @ recovery_sidecar::LockError::Owned(_) => {
            ApiError::new(ErrorCode::RunLocked, owned.to_string())
        }
        refused @ (recovery_sidecar::LockError::NotAFile(_)
        | recovery_sidecar::LockError::Moved(_)) => {
            ApiError::new(ErrorCode::PathRefused, refused.to_string())
        }
        gone @ recovery_sidecar::LockError::DirectoryGone(_) => {
            ApiError::new(ErrorCode::NoManifest, gone.to_string())
        }
        io @ recovery_sidecar::LockError::Io { .. } => {
            ApiError::internal("opening the run's lock file", io)
        }
    }
}

/// The public view of a lease holder (no lease id: that is the holder's secret), as
/// [`lease_holder`] writes it.
#[derive(Debug, Clone, Serialize, ToSchema)]
pub struct LeaseHolder {
    pub holder: String,
    pub host: String,
    pub pid: i64,
    pub acquired_at: String,
    pub renewed_at: String,
    pub expires_at: String,
}

/// The public view of a lease holder (no lease id: that is the holder's secret).
pub fn lease_holder(lease: &recovery_store::Lease) -> serde_json::Value {
    serde_json::json!({
        "holder": lease.holder,
        "host": lease.host,
        "pid": lease.pid,
        "acquired_at": lease.acquired_at,
        "renewed_at": lease.renewed_at,
        "expires_at": lease.expires_at,
    })
}

pub type ApiResult<T> = Result<T, ApiError>;

/// The largest page any list answers.
pub const MAX_PAGE: u32 = 1000;

/// A page size: `default` when absent, refused outside 1..=[`MAX_PAGE`] (never clamped, so a
/// client asking for 5000 learns it gets at most 1000).
pub fn page_limit(limit: Option<u32>, default: u32) -> ApiResult<u32> {
    match limit {
        None => Ok(default),
        Some(limit @ 1..=MAX_PAGE) => Ok(limit),
        Some(other) => Err(ApiError::invalid_field(
            "limit",
            format!("limit: {other} is out of range: must be between 1 and {MAX_PAGE}"),
        )),
    }
}

/// A keyset page from `rows`, read with one row more than `limit`: the rows of the page, and
/// the encoded cursor of its last row when that extra row showed another one follows.
pub fn keyset_page<T>(
    mut rows: Vec<T>,
    limit: u32,
    list: crate::routes::query::CursorList,
    cursor_of: impl Fn(&T) -> recovery_store::Cursor,
) -> (Vec<T>, Option<String>) {
    let more = rows.len() > limit as usize;
    rows.truncate(limit as usize);
    let next = more.then(|| rows.last().map(|last| list.encode(&cursor_of(last))));
    (rows, next.flatten())
}

/// `Json<T>` whose rejections answer in the API error shape (the serde message names the field).
#[derive(Debug, Clone, Copy, Default)]
pub struct ApiJson<T>(pub T);

impl<S, T> axum::extract::FromRequest<S> for ApiJson<T>
where
    T: serde::de::DeserializeOwned,
    S: Send + Sync,
{
    type Rejection = ApiError;

    async fn from_request(
        request: axum::extract::Request,
        state: &S,
    ) -> Result<Self, Self::Rejection> {
        // One reader of every JSON body: the same content-type check, body limit, depth limit
        // and field-naming messages as the bodies parsed on blocking threads.
        let ApiJsonBytes(body) = ApiJsonBytes::from_request(request, state).await?;
        parse_json_body(&body).map(Self)
    }
}

/// A JSON body kept as bytes (parsed by the handler, off the async workers), with the checks and
/// rejections of [`ApiJson`]: the JSON content type and the body limit.
#[derive(Debug, Clone, Default)]
pub struct ApiJsonBytes(pub axum::body::Bytes);

/// A JSON answer serialised where it was computed (a heavy-work thread), so a large answer
/// never occupies the async workers that keep `/healthz` and cheap calls quick.
#[derive(Debug, Clone)]
pub struct SerializedJson(pub axum::body::Bytes);

impl SerializedJson {
    /// Serialises `value` here.
    pub fn of(value: &impl serde::Serialize) -> ApiResult<Self> {
        serde_json::to_vec(value)
            .map(|bytes| Self(bytes.into()))
            .map_err(|e| ApiError::internal("serialising the answer", e))
    }
}

impl IntoResponse for SerializedJson {
    fn into_response(self) -> Response {
        (
            [(
                axum::http::header::CONTENT_TYPE,
                axum::http::HeaderValue::from_static("application/json"),
            )],
            self.0,
        )
            .into_response()
    }
}

impl<S: Send + Sync> axum::extract::FromRequest<S> for ApiJsonBytes {
    type Rejection = ApiError;

    async fn from_request(
        request: axum::extract::Request,
        state: &S,
    ) -> Result<Self, Self::Rejection> {
        let json = request
            .headers()
            .get(axum::http::header::CONTENT_TYPE)
            .and_then(|v| v.to_str().ok())
            .is_some_and(|v| v.starts_with("application/json") || v.contains("+json"));
        if !json {
            return Err(ApiError::invalid(
                "the body must be JSON with content-type: application/json",
            ));
        }
        match axum::body::Bytes::from_request(request, state).await {
            Ok(bytes) => Ok(Self(bytes)),
            Err(e) if e.status() == StatusCode::PAYLOAD_TOO_LARGE => Err(ApiError::new(
                ErrorCode::PayloadTooLarge,
                "the request body is larger than the service accepts (RR_BODY_LIMIT_MB)",
            )),
            Err(e) => Err(ApiError::invalid(format!("body: {}", e.body_text()))),
        }
    }
}

/// The field serde names in a "missing field `x`" or "unknown field `x`, ..." message.
fn named_field(message: &str) -> Option<String> {
    let rest = message
        .strip_prefix("missing field `")
        .or_else(|| message.strip_prefix("unknown field `"))
        .or_else(|| message.strip_prefix("duplicate field `"))?;
    rest.split_once('`').map(|(field, _)| field.to_owned())
}

/// Parses a JSON body read by [`ApiJsonBytes`] (on a blocking thread for large bodies), naming
/// the field at fault.
pub fn parse_json_body<'de, T: serde::Deserialize<'de>>(body: &'de [u8]) -> ApiResult<T> {
    // The depth is bounded here, before serde recurses, so the parser's own limit of 128 can be
    // lifted: a body nests up to the 512 levels a digest takes, on every endpoint.
    recovery_core::canonical::check_depth(body)
        .map_err(|e| ApiError::invalid(format!("body: {e}")))?;
    parse_shallow_json_body(body)
}

/// [`parse_json_body`] without its depth pass, for bodies whose every nested value is read as a
/// raw text (`RawValue`), or as a string or a flat map of strings: serde skips over a raw text
/// without recursing, so no depth makes it overflow, and each raw text is depth-checked by
/// whatever parses it later (the core's readers). Validate takes this path: the depth pass
/// was ~14% of the CPU of a validate carrying 1,000 rows.
pub fn parse_shallow_json_body<'de, T: serde::Deserialize<'de>>(body: &'de [u8]) -> ApiResult<T> {
    // Every body is an object: serde would also read a struct from a positional array.
    if body
        .iter()
        .find(|b| !b.is_ascii_whitespace())
        .is_some_and(|first| *first != b'{')
    {
        return Err(ApiError::invalid(match not_json(body) {
            // Not JSON at all (another encoding, a form): said so, with where it stops.
            Some(e) => format!("body: must be a JSON object, and is not JSON: {e}"),
            None => "body: must be a JSON object".to_owned(),
        }));
    }
    let mut deserializer = serde_json::Deserializer::from_slice(body);
    deserializer.disable_recursion_limit();
    let value = serde_path_to_error::deserialize(&mut deserializer).map_err(|e| {
        let path = e.path().to_string();
        let inner = e.into_inner();
        let syntax = inner.is_syntax() || inner.is_eof();
        // serde stops at the first field it cannot take, before it has read the rest: a body
        // that is not JSON at all (`{"a":` cut short) is refused as such, not for its fields.
        if let Some(malformed) = (!syntax).then(|| not_json(body)).flatten() {
            return ApiError::invalid(format!("body: malformed JSON: {malformed}"));
        }
        if let Some(unnamed) = (!syntax)
            .then(|| unknown_key_unrepeated(&without_position(&inner)))
            .flatten()
        {
            return ApiError::invalid(format!("body: {unnamed}"));
        }
        // serde_path_to_error writes `?` for a place it cannot name (a key not yet read).
        if syntax && (path == "." || path.contains('?')) {
            ApiError::invalid(format!("body: malformed JSON: {inner}"))
        } else if syntax {
            // Where the text stops being JSON (a lone surrogate in a row, a body cut short).
            ApiError::invalid_field(
                &path,
                format!("{path}: malformed JSON: {inner}{}", surrogate_hint(&inner)),
            )
        } else if path == "." {
            // A missing or unknown field is named only by serde's message.
            let said = without_position(&inner);
            match named_field(&said) {
                Some(field) => {
                    let hint = alias_hint(&said, body);
                    ApiError::invalid_field(&field, format!("{field}: {said}{hint}"))
                }
                None => ApiError::invalid(format!("body: {said}")),
            }
        } else if let Some(field) = unknown_field_at(&path, &without_position(&inner)) {
            // A key no field has, whatever it is called (`password` is no field either): said
            // as unknown, not as a field whose value is wrong.
            ApiError::invalid_field(&field, format!("{field}: {}", without_position(&inner)))
        } else if may_hold_a_credential(&path) {
            // `environment` is where collectors put credentials: a value of the wrong type is
            // refused without being repeated (collectors log refusals).
            let said = without_position(&inner);
            let expected = said
                .rsplit_once(", expected ")
                .map_or("something else".to_owned(), |(_, e)| e.to_owned());
            ApiError::invalid_field(
                &path,
                format!(
                    "{path}: invalid value, expected {expected} (the value is not shown: it may be a credential)"
                ),
            )
        } else if let Some(integer) = integer_out_of_range(body, &inner) {
            // serde_json reads an integer past 64 bits as a float and says "floating point".
            let expected = without_position(&inner);
            let expected = expected.rsplit_once(", ").map_or("", |(_, e)| e);
            ApiError::invalid_field(
                &path,
                format!("{path}: invalid value: {integer} is out of range, {expected}"),
            )
        } else {
            // The field first, as every other refusal of a field says it.
            let said = without_quoted_value(without_position(&inner));
            ApiError::invalid_field(&path, format!("{path}: {said}"))
        }
    })?;
    deserializer
        .end()
        .map_err(|e| ApiError::invalid(format!("body: malformed JSON: {e}")))?;
    Ok(value)
}

/// The key serde refused as unknown at `path` (a nested object's key is named by its path).
fn unknown_field_at(path: &str, said: &str) -> Option<String> {
    said.starts_with("unknown field `")
        .then(|| path.to_owned())
        .filter(|path| !path.is_empty() && path != ".")
}

/// serde's "unknown field `key`, expected ..." without the key, when the key does not read as a
/// field name: a key no field has may be what a caller pasted in the wrong place (a token), and
/// is not repeated (hostile review 29). `None` for every other message.
fn unknown_key_unrepeated(said: &str) -> Option<String> {
    let rest = said.strip_prefix("unknown field `")?;
    // The key ends where serde's words resume (it may hold a backtick itself).
    let end = rest
        .find("`, expected ")
        .or_else(|| rest.find("`, there are no fields"))?;
    (!reads_as_field_name(&rest[..end])).then(|| {
        format!(
            "unknown field (its name is not repeated){}",
            &rest[end + 1..]
        )
    })
}

/// [`unknown_key_unrepeated`] for a query string, whose refusal names the parameter first
/// (`<key>: unknown field `<key>`, expected ...`).
fn unknown_parameter_unrepeated(text: &str) -> Option<String> {
    text.match_indices(": unknown field `").find_map(|(at, _)| {
        let said = &text[at + 2..];
        let key = &text[..at];
        said.strip_prefix("unknown field `")
            .is_some_and(|rest| rest.starts_with(&format!("{key}`")))
            .then(|| unknown_key_unrepeated(said))
            .flatten()
    })
}

/// Whether an unknown key reads as a misspelt field name (`output_pth`), which is worth naming
/// back, rather than arbitrary text: at most 64 lowercase letters, digits or `_`, as every field
/// and parameter name is. Tokens have other characters (`sk-...`, `ghp_AbC...`), and are not
/// repeated (hostile review 31: `-`, `.` and capitals let a pasted token be echoed).
fn reads_as_field_name(key: &str) -> bool {
    !key.is_empty()
        && key.len() <= 64
        && key
            .bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'_')
}

/// Why a field sent once can be "duplicate": it was also sent under its other name. serde
/// names both spellings `allow_unsafe`, so the body tells whether both were sent (a name sent
/// twice gets serde's words alone).
fn alias_hint(said: &str, body: &[u8]) -> &'static str {
    let holds = |name: &[u8]| body.windows(name.len()).any(|w| w == name);
    if said == "duplicate field `allow_unsafe`"
        && holds(b"\"allow_unsafe\"")
        && holds(b"\"allow_unsafe_resume\"")
    {
        " (`allow_unsafe_resume` is another name for `allow_unsafe`: send one of the two)"
    } else {
        ""
    }
}

/// What serde_json's words for a `\uD800`-`\uDFFF` escape without its other half mean.
fn surrogate_hint(error: &serde_json::Error) -> &'static str {
    let text = error.to_string();
    if text.starts_with("unexpected end of hex escape") || text.contains("surrogate") {
        " (a \\uD800-\\uDFFF escape is half of a surrogate pair: a lone one is no character)"
    } else {
        ""
    }
}

/// serde's message without the text of a string it could not take (`invalid type: string
/// "Bearer ...", expected a boolean`, `unknown variant `...``) or the name of an unknown key
/// that does not read as a field name: a caller that put a token in the wrong place is told
/// the field and what it takes, never shown the token again.
pub fn without_quoted_value(said: String) -> String {
    static QUOTED: std::sync::LazyLock<regex::Regex> = std::sync::LazyLock::new(|| {
        // serde writes a string it could not take with Rust's escapes (`string "a\"b"`), a
        // variant's name between backticks.
        regex::Regex::new(r#"string "(?:[^"\\]|\\.)*"|unknown variant `[^`]*`"#)
            .expect("static regex")
    });
    let said = QUOTED
        .replace_all(&said, |found: &regex::Captures| {
            if found[0].starts_with("string") {
                "a string"
            } else {
                "unknown value"
            }
        })
        .into_owned();
    // A nested object's unknown key (a classify `policy`'s) comes inside another message.
    match said.find("unknown field `") {
        Some(at) => match unknown_key_unrepeated(&said[at..]) {
            Some(unnamed) => format!("{}{unnamed}", &said[..at]),
            None => said,
        },
        None => said,
    }
}

/// Whether a body field's value may be a secret, so that a refusal must not repeat it: the
/// `environment` map (where collectors send credentials) and any credential-named field.
fn may_hold_a_credential(path: &str) -> bool {
    path == "environment"
        || path.starts_with("environment.")
        || path.starts_with("environment[")
        || path
            .split(['.', '[', ']'])
            .any(recovery_core::identity::redaction::is_credential_name)
}

/// Where `body` stops being JSON, if it does (nesting past the parser's own limit is not
/// reported here: the caller's reader allows it).
fn not_json(body: &[u8]) -> Option<serde_json::Error> {
    use serde::Deserialize as _;
    let mut deserializer = serde_json::Deserializer::from_slice(body);
    serde::de::IgnoredAny::deserialize(&mut deserializer)
        .and_then(|_| deserializer.end())
        .err()
        .filter(|e| e.is_syntax() || e.is_eof())
        .filter(|e| !e.to_string().starts_with("recursion limit exceeded"))
}

/// The integer literal a "floating point" type error is about, when it was written as an
/// integer (too large for 64 bits, so serde_json read it as a float): the text just before
/// where the error is reported.
fn integer_out_of_range<'a>(body: &'a [u8], error: &serde_json::Error) -> Option<&'a str> {
    if !error
        .to_string()
        .starts_with("invalid type: floating point")
    {
        return None;
    }
    let line_start = body
        .split_inclusive(|b| *b == b'\n')
        .take(error.line().saturating_sub(1))
        .map(<[u8]>::len)
        .sum::<usize>();
    let end = (line_start + error.column()).min(body.len());
    let before = &body[..end];
    let start = before
        .iter()
        .rposition(|b| !(b.is_ascii_digit() || matches!(b, b'-' | b'+' | b'.' | b'e' | b'E')))
        .map_or(0, |i| i + 1);
    let literal = std::str::from_utf8(&before[start..]).ok()?;
    let digits = literal.strip_prefix('-').unwrap_or(literal);
    (!digits.is_empty() && digits.bytes().all(|b| b.is_ascii_digit())).then_some(literal)
}

/// The Rust type names serde's messages end with, in words a caller reads (`pid: invalid
/// type: string "1", expected an integer`, not `expected i64`).
const TYPE_WORDS: [(&str, &str); 8] = [
    ("expected i64", "expected an integer"),
    ("expected i32", "expected an integer"),
    ("expected u64", "expected an integer of 0 or more"),
    ("expected u32", "expected an integer of 0 or more"),
    ("expected u16", "expected an integer of 0 or more"),
    ("expected usize", "expected an integer of 0 or more"),
    ("expected f64", "expected a number"),
    ("expected f32", "expected a number"),
];

/// serde's message without its ` at line 1 column 63` (the field it names says where) and with
/// its type names in words ([`TYPE_WORDS`]).
fn without_position(error: &serde_json::Error) -> String {
    let text = error.to_string();
    let position = format!(" at line {} column {}", error.line(), error.column());
    let text = text.strip_suffix(&position).unwrap_or(&text);
    TYPE_WORDS
        .iter()
        .find_map(|(rust, words)| {
            text.strip_suffix(rust)
                .map(|start| format!("{start}{words}"))
        })
        .unwrap_or_else(|| text.to_owned())
}

/// `Query<T>` whose rejections answer in the API error shape.
#[derive(Debug, Clone, Copy, Default)]
pub struct ApiQuery<T>(pub T);

impl<S, T> axum::extract::FromRequestParts<S> for ApiQuery<T>
where
    T: serde::de::DeserializeOwned,
    S: Send + Sync,
{
    type Rejection = ApiError;

    async fn from_request_parts(
        parts: &mut axum::http::request::Parts,
        state: &S,
    ) -> Result<Self, Self::Rejection> {
        axum::extract::Query::<T>::from_request_parts(parts, state)
            .await
            .map(|axum::extract::Query(value)| Self(value))
            .map_err(|e| {
                let text = e.body_text();
                let text = text.trim_start_matches("Failed to deserialize query string: ");
                if let Some(unnamed) = unknown_parameter_unrepeated(text) {
                    return ApiError::invalid(format!("query: {unnamed}"));
                }
                // The framework names the parameter first (`limit: invalid digit ...`).
                let field = text
                    .split_once(": ")
                    .map(|(field, _)| field)
                    .filter(|field| {
                        !field.is_empty()
                            && field
                                .bytes()
                                .all(|b| b.is_ascii_alphanumeric() || b == b'_')
                    })
                    .map(str::to_owned)
                    // An unknown or repeated parameter is named only by serde's message.
                    .or_else(|| named_field(text));
                match field {
                    // The parameter comes first in the message, as a body field's does.
                    Some(field) if text.starts_with(&format!("{field}: ")) => {
                        let reason = &text[field.len() + 2..];
                        let value = query_value(parts.uri.query().unwrap_or(""), &field);
                        let said = value
                            .and_then(|value| integer_in_words(reason, &value, &field))
                            .unwrap_or_else(|| without_quoted_value(reason.to_owned()));
                        ApiError::invalid_field(&field, format!("{field}: {said}"))
                    }
                    Some(field) => ApiError::invalid_field(&field, format!("{field}: {text}")),
                    None => ApiError::invalid(format!("query: {text}")),
                }
            })
    }
}

/// The first value of the query parameter `name`, decoded.
fn query_value(query: &str, name: &str) -> Option<String> {
    form_urlencoded::parse(query.as_bytes())
        .find(|(key, _)| key == name)
        .map(|(_, value)| value.into_owned())
}

/// An integer parameter's refusal in words naming the value, for the standard library's
/// reasons (`invalid digit found in string` said the same of `-1` and of `abc`).
fn integer_in_words(reason: &str, value: &str, field: &str) -> Option<String> {
    let negative = value
        .strip_prefix('-')
        .is_some_and(|digits| !digits.is_empty() && digits.bytes().all(|b| b.is_ascii_digit()));
    // A page size's range is said as `page_limit` says it of `0`.
    let out_of_range = reason == "number too large to fit in target type"
        || (reason == "invalid digit found in string" && negative);
    if field == "limit" && out_of_range {
        return Some(format!(
            "{value} is out of range: must be between 1 and {MAX_PAGE}"
        ));
    }
    match reason {
        "number too large to fit in target type" => Some(format!("{value} is out of range")),
        "invalid digit found in string" if negative => {
            Some(format!("{value} is out of range: it is negative"))
        }
        // A value that reads as a number is said back (`"1.5"`); any other could be a pasted
        // credential and is not repeated.
        "invalid digit found in string" if reads_as_number(value) => {
            Some(format!("{value:?} is not an integer"))
        }
        "invalid digit found in string" => {
            Some("is not an integer (the value is not repeated)".to_owned())
        }
        "cannot parse integer from empty string" => {
            Some("must not be empty (an integer)".to_owned())
        }
        _ => None,
    }
}

/// Up to 32 characters of what a number is written with (digits, sign, point, exponent).
fn reads_as_number(value: &str) -> bool {
    value.len() <= 32
        && value
            .bytes()
            .all(|b| b.is_ascii_digit() || matches!(b, b'.' | b'-' | b'+' | b'e' | b'E'))
}

/// Answers that layers below the handlers produce as plain text (a body over the limit refused
/// from its Content-Length, a method the route does not take) are put in the API error shape.
pub async fn in_error_shape(response: Response) -> Response {
    let is_json = response
        .headers()
        .get(axum::http::header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v.starts_with("application/json"));
    if is_json {
        return response;
    }
    match response.status() {
        StatusCode::PAYLOAD_TOO_LARGE => ApiError::new(
            ErrorCode::PayloadTooLarge,
            "the request body is larger than the service accepts (RR_BODY_LIMIT_MB)",
        )
        .into_response(),
        StatusCode::REQUEST_TIMEOUT => ApiError::new(
            ErrorCode::RequestTimeout,
            "the request took longer than the service allows (RR_REQUEST_TIMEOUT_SECS); heavy reads it started are stopped, a change it started runs to completion (read the run before retrying)",
        )
        .into_response(),
        StatusCode::METHOD_NOT_ALLOWED => {
            let allowed = response.headers().get(axum::http::header::ALLOW).cloned();
            let mut shaped = ApiError::new(
                ErrorCode::MethodNotAllowed,
                "this route does not take that method (see the Allow header)",
            )
            .into_response();
            if let Some(allowed) = allowed {
                shaped
                    .headers_mut()
                    .insert(axum::http::header::ALLOW, allowed);
            }
            shaped
        }
        // A path parameter the router could not decode (invalid UTF-8 after percent-decoding):
        // the framework's one-line text names the parameter.
        StatusCode::BAD_REQUEST => {
            let text = axum::body::to_bytes(response.into_body(), 1024)
                .await
                .map(|bytes| String::from_utf8_lossy(&bytes).trim().to_owned())
                .unwrap_or_default();
            ApiError::invalid(format!("the request's path could not be read: {text}"))
                .into_response()
        }
        _ => response,
    }
}

/// The longest request target (path and query) read.
pub const MAX_URI_BYTES: usize = 8 * 1024;
/// The most header bytes (names and values) read.
pub const MAX_HEADER_BYTES: usize = 64 * 1024;

/// Refuses a request head larger than the service reads, in the error shape, before any
/// extractor sees it. (Beyond the HTTP library's own limits, a target over 64 KiB or more than
/// 100 headers, the library answers 414 or 431 itself, without a body.)
pub fn oversized_head(request: &axum::extract::Request) -> Option<Response> {
    let target = request
        .uri()
        .path_and_query()
        .map_or(0, |p| p.as_str().len());
    if target > MAX_URI_BYTES {
        return Some(ApiError::new(
            ErrorCode::UriTooLong,
            format!(
                "the request target is {target} bytes; the service reads at most {MAX_URI_BYTES}"
            ),
        )
        .into_response());
    }
    let headers: usize = request
        .headers()
        .iter()
        .map(|(name, value)| name.as_str().len() + value.len())
        .sum();
    if headers > MAX_HEADER_BYTES {
        return Some(ApiError::new(
            ErrorCode::HeadersTooLarge,
            format!("the request headers are {headers} bytes; the service reads at most {MAX_HEADER_BYTES}"),
        )
        .into_response());
    }
    None
}

/// Unknown routes answer in the API error shape.
pub async fn fallback(uri: axum::http::Uri) -> ApiError {
    ApiError::not_found(format!("no endpoint {}", uri.path()))
}

/// For operations that take no query parameters: any is refused naming it, as an unknown
/// parameter of a list is (a misspelt option would otherwise be ignored silently).
pub async fn refuse_query(
    request: axum::extract::Request,
    next: axum::middleware::Next,
) -> Response {
    let first = request
        .uri()
        .query()
        .and_then(|query| form_urlencoded::parse(query.as_bytes()).next())
        .map(|(name, _)| name.into_owned());
    match first {
        Some(name) if reads_as_field_name(&name) => ApiError::invalid_field(
            &name,
            format!("{name}: unknown query parameter (this operation takes none)"),
        )
        .into_response(),
        // A name no parameter could have may be a pasted token: not repeated (hostile review
        // 33), as the lists' refusals do.
        Some(_) => ApiError::new(
            ErrorCode::InvalidRequest,
            "unknown query parameter (its name is not repeated; this operation takes none)",
        )
        .into_response(),
        None => next.run(request).await,
    }
}
