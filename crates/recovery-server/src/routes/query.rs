//! Read models for dashboards and tools: drift history, classification, the resume plan.

use crate::config::{Caller, Role};
use crate::error::{
    ApiError, ApiErrorBody, ApiJsonBytes, ApiQuery, ApiResult, ErrorCode, SerializedJson,
};
use crate::state::AppState;
use axum::extract::{Path, State};
use recovery_core::facts::RowFacts;
use recovery_core::failure::ClassificationPolicy;
use recovery_core::plan::{Coverage, PlanEntry, PlanState, RowDecision, classify_facts};
use recovery_store::{Cursor, DriftEvent, DriftFilter, DriftFollow};
use serde::{Deserialize, Serialize};
use serde_json::Value;
use std::collections::BTreeMap;
use utoipa::{IntoParams, ToSchema};

/// Which drift events to list across runs: [`RunDriftParams`] and a run filter. A parameter
/// it does not know is refused (a misspelt filter would otherwise list every event).
#[derive(Debug, Clone, Default, Deserialize, IntoParams)]
#[serde(deny_unknown_fields)]
#[into_params(parameter_in = Query)]
pub struct DriftParams {
    /// Only this run's events.
    #[serde(default, deserialize_with = "crate::limits::opt_id")]
    #[param(min_length = 1, max_length = 256)]
    pub run_id: Option<String>,
    /// Inclusive start (RFC 3339 UTC, e.g. 2026-11-29T00:00:00Z).
    #[param(max_length = 64)]
    pub from: Option<String>,
    /// Exclusive end (RFC 3339 UTC).
    #[param(max_length = 64)]
    pub to: Option<String>,
    /// Only events whose drifted keys include this dotted key.
    #[param(max_length = 1000)]
    pub key: Option<String>,
    /// At most this many (1-1000, default 100).
    #[param(minimum = 1, maximum = 1000)]
    pub limit: Option<u32>,
    /// Where the previous page ended (its `next_cursor`, or in `recorded` order its
    /// `follow_cursor`).
    #[param(max_length = 400)]
    pub cursor: Option<String>,
    /// `time` (default): by `at`, for reading history. `newest`: by `at`, newest first.
    /// `recorded`: in the order the service recorded the events, for following the history
    /// while it is written (see `follow_cursor`).
    pub order: Option<DriftOrder>,
}

/// Which drift events of one run to list (unknown parameters refused, as for [`DriftParams`]).
#[derive(Debug, Clone, Default, Deserialize, IntoParams)]
#[serde(deny_unknown_fields)]
#[into_params(parameter_in = Query)]
pub struct RunDriftParams {
    /// Inclusive start (RFC 3339 UTC, e.g. 2026-11-29T00:00:00Z).
    #[param(max_length = 64)]
    pub from: Option<String>,
    /// Exclusive end (RFC 3339 UTC).
    #[param(max_length = 64)]
    pub to: Option<String>,
    /// Only events whose drifted keys include this dotted key.
    #[param(max_length = 1000)]
    pub key: Option<String>,
    /// At most this many (1-1000, default 100).
    #[param(minimum = 1, maximum = 1000)]
    pub limit: Option<u32>,
    /// Where the previous page ended (its `next_cursor`, or in `recorded` order its
    /// `follow_cursor`).
    #[param(max_length = 400)]
    pub cursor: Option<String>,
    /// `time` (default): by `at`, for reading history. `newest`: by `at`, newest first.
    /// `recorded`: in the order the service recorded the events, for following the history
    /// while it is written (see `follow_cursor`).
    pub order: Option<DriftOrder>,
}

impl DriftParams {
    /// The run filter and the rest.
    fn split(self) -> (Option<String>, RunDriftParams) {
        let DriftParams {
            run_id,
            from,
            to,
            key,
            limit,
            cursor,
            order,
        } = self;
        let rest = RunDriftParams {
            from,
            to,
            key,
            limit,
            cursor,
            order,
        };
        (run_id, rest)
    }
}

/// The order of a drift page.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize, ToSchema)]
#[serde(rename_all = "snake_case")]
pub enum DriftOrder {
    /// By the events' times, then ids: history as it happened. Events are timed before they
    /// are written, so an event can commit behind a cursor already handed out; follow with
    /// `recorded`.
    #[default]
    Time,
    /// In the order the service recorded them: an event recorded later is always after every
    /// cursor handed out before it.
    Recorded,
    /// By the events' times, newest first (a dashboard's latest events); `next_cursor` goes on
    /// to older ones.
    Newest,
}

#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
pub struct DriftPage {
    pub events: Vec<DriftEvent>,
    /// Present when more events match now: pass it as `cursor` for the next page.
    pub next_cursor: Option<String>,
    /// In `recorded` order, always present: pass it as `cursor` (with `order=recorded`) later
    /// to receive exactly the matching events recorded after this page. Null in `time` and
    /// `newest` order.
    pub follow_cursor: Option<String>,
}

/// The text of a recorded-order cursor: `recorded:<epoch>:<position>`.
const RECORDED_CURSOR: &str = "recorded:";

/// A place in the recorded order: a position of one numbering (the database's epoch).
#[derive(Debug, Clone, PartialEq, Eq)]
struct RecordedCursor {
    epoch: String,
    position: i64,
}

impl RecordedCursor {
    fn encode(&self) -> String {
        format!("{RECORDED_CURSOR}{}:{}", self.epoch, self.position)
    }

    /// A cursor as [`Self::encode`] writes it; a time cursor or any other text is refused.
    fn decode(text: &str) -> ApiResult<Self> {
        let digits = |s: &str, hex: bool| {
            !s.is_empty()
                && s.len() <= 32
                && s.bytes()
                    .all(|b| b.is_ascii_digit() || (hex && matches!(b, b'a'..=b'f')))
        };
        text.strip_prefix(RECORDED_CURSOR)
            .and_then(|rest| rest.split_once(':'))
            .filter(|(epoch, position)| digits(epoch, true) && digits(position, false))
            .and_then(|(epoch, position)| {
                Some(Self {
                    epoch: epoch.to_owned(),
                    position: position.parse().ok()?,
                })
            })
            // One spelling per place, as issued (`007` is not a position this service wrote).
            .filter(|cursor| cursor.encode() == text)
            .ok_or_else(|| not_a_cursor(" for order=recorded"))
    }
}

/// Why a recorded-order cursor cannot be followed in this database.
fn cursor_expired(message: String) -> ApiError {
    ApiError::new(ErrorCode::CursorExpired, message)
        .with_details(serde_json::json!({ "field": "cursor" }))
}

fn not_a_cursor(detail: &str) -> ApiError {
    ApiError::invalid_field(
        "cursor",
        format!("cursor: not a cursor this service issued{detail}"),
    )
}

/// The lists a `(time, id)` cursor pages. A cursor starts with its list's name
/// (`audit|<time>|<id>`), so one list's cursor given to another is refused naming `cursor`,
/// never read as a place in it (hostile review 53, F7: `/audit` answered an empty page for a
/// drift cursor, `/runs` a page from somewhere for an audit one).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CursorList {
    Runs,
    Validations,
    Audit,
    Drift,
}

impl CursorList {
    fn name(self) -> &'static str {
        match self {
            Self::Runs => "runs",
            Self::Validations => "validations",
            Self::Audit => "audit",
            Self::Drift => "drift",
        }
    }

    /// The cursor's text as this list hands it out.
    pub fn encode(self, cursor: &Cursor) -> String {
        format!("{}|{}", self.name(), cursor.encode())
    }

    /// A cursor this list handed out; `None` for any other text (another list's included).
    pub fn decode(self, text: &str) -> Option<Cursor> {
        text.strip_prefix(self.name())?
            .strip_prefix('|')
            .and_then(Cursor::decode)
    }
}

/// A `(time, id)` cursor as this service writes them for `list`. Its time is in the stored
/// form: a cursor whose `+`/`:` a client did not encode is refused, never read as another place
/// (which repeated a page). Its id is an event's or audit entry's: lowercase hex digits.
pub fn time_cursor(list: CursorList, text: &str) -> ApiResult<Cursor> {
    list.decode(text)
        .filter(|c| recovery_sidecar::normalize_rfc3339(&c.at).is_ok_and(|at| at == c.at))
        .filter(|c| {
            c.id.len() <= 64 && c.id.bytes().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f'))
        })
        .ok_or_else(|| not_a_cursor(""))
}

/// A drift list's time-order cursor: a recorded-order one is refused saying which order it is.
fn drift_time_cursor(text: &str) -> ApiResult<Cursor> {
    if text.starts_with(RECORDED_CURSOR) {
        return Err(not_a_cursor(
            " for order=time or order=newest (pass order=recorded with it)",
        ));
    }
    time_cursor(CursorList::Drift, text)
}

/// An RFC 3339 bound in the stored form (rounded up to the microsecond the stored times have:
/// [`recovery_sidecar::stored_time_bound`]).
fn time_bound(field: &str, text: &str) -> ApiResult<String> {
    let refused = |reason: String| {
        ApiError::invalid_field(
            field,
            // The text is not repeated: it may be anything (a query string is logged by
            // proxies, not by this service, but refusals never repeat what was sent).
            format!("{field}: not an RFC 3339 time: {reason}"),
        )
    };
    match recovery_sidecar::stored_time_bound(text) {
        Ok(bound) => Ok(bound),
        // A query string reads an unencoded `+` as a space: the offset's sign is lost.
        Err(e) if text.contains(' ') => Err(refused(format!(
            "{e} (a `+` in a query string is read as a space: send it as %2B)"
        ))),
        Err(e) => Err(refused(e.to_string())),
    }
}

/// A page of drift events: a [`DriftPage`].
async fn drift_page(
    state: &AppState,
    params: RunDriftParams,
    run_id: Option<String>,
) -> ApiResult<SerializedJson> {
    let limit = crate::error::page_limit(params.limit, 100)?;
    // An empty filter would match nothing, silently: refused like any other empty field.
    for (field, value) in [("run_id", &run_id), ("key", &params.key)] {
        if value.as_deref().is_some_and(|v| v.trim().is_empty()) {
            return Err(ApiError::invalid_field(
                field,
                format!("{field}: must not be empty (leave it out to match every event)"),
            ));
        }
    }
    let from = params
        .from
        .as_deref()
        .map(|t| time_bound("from", t))
        .transpose()?;
    let to = params
        .to
        .as_deref()
        .map(|t| time_bound("to", t))
        .transpose()?;
    if let (Some(from), Some(to)) = (&from, &to) {
        if from >= to {
            return Err(ApiError::invalid_field(
                "to",
                format!("to: {to} is not after from ({from}): the range holds no time"),
            ));
        }
    }
    let order = params.order.unwrap_or_default();
    if order == DriftOrder::Recorded {
        let cursor = params
            .cursor
            .as_deref()
            .map(RecordedCursor::decode)
            .transpose()?;
        let follow = DriftFollow {
            run_id,
            key: params.key,
            from,
            to,
            after: cursor.as_ref().map_or(0, |c| c.position),
            limit: limit + 1,
        };
        return SerializedJson::of(&followed_page(state, follow, cursor, limit).await?);
    }
    let filter = DriftFilter {
        run_id,
        key: params.key,
        from,
        to,
        after: params
            .cursor
            .as_deref()
            .map(drift_time_cursor)
            .transpose()?,
        limit,
        newest_first: order == DriftOrder::Newest,
    };
    let page = state.registry.store().query_drift_rendered(&filter).await?;
    // The events are the database's JSON text, passed through ([`DriftPage`]'s shape).
    let next_cursor = serde_json::to_string(
        &page
            .next
            .as_ref()
            .map(|cursor| CursorList::Drift.encode(cursor)),
    )
    .map_err(|e| ApiError::internal("serialising the answer", e))?;
    // Built once per kept page: a dashboard's repeated page is sent without a copy.
    let body = page.answer.get_or_init(|| {
        format!(
            "{{\"events\":{},\"next_cursor\":{next_cursor},\"follow_cursor\":null}}",
            page.events_json
        )
        .into()
    });
    Ok(SerializedJson(body.clone()))
}

/// A page in recorded order (`follow.limit` is one more than the page).
async fn followed_page(
    state: &AppState,
    follow: DriftFollow,
    cursor: Option<RecordedCursor>,
    limit: u32,
) -> ApiResult<DriftPage> {
    let mut page = state.registry.store().follow_drift(&follow).await?;
    if let Some(cursor) = &cursor {
        if cursor.epoch != page.epoch {
            return Err(cursor_expired(
                "cursor: the drift history was numbered anew since this cursor was issued (the \
                 database was made again, or a start indexed drift it lacked, as after a \
                 restore); follow again without a cursor and drop the event ids you already have"
                    .into(),
            ));
        }
        if cursor.position > page.head {
            // Positions only grow, so no cursor of this numbering is past its head unless the
            // database went back to an older backup.
            return Err(cursor_expired(format!(
                "cursor: position {} is past the last one recorded ({}): the database went \
                 back to an older state (a restore), or the cursor was not issued here; follow \
                 again without a cursor and drop the event ids you already have",
                cursor.position, page.head
            )));
        }
    }
    let more = page.events.len() > limit as usize;
    page.events.truncate(limit as usize);
    let last = page.events.last().map(|(position, _)| *position);
    // With more to come the page ends at its last event; otherwise every match up to the
    // snapshot's head is in it, so following resumes from the head (a rare filter does not
    // rescan what it already passed).
    let follow_at = RecordedCursor {
        epoch: page.epoch,
        position: match (more, last) {
            (true, Some(position)) => position,
            _ => page.head,
        },
    }
    .encode();
    Ok(DriftPage {
        next_cursor: more.then(|| follow_at.clone()),
        follow_cursor: Some(follow_at),
        events: page.events.into_iter().map(|(_, event)| event).collect(),
    })
}

/// Every resume that crossed operational drift, across runs (oldest first).
#[utoipa::path(get, path = "/drift", tag = "drift", params(DriftParams),
    responses((status = 200, body = DriftPage), (status = 422, body = ApiErrorBody), (status = 410, body = ApiErrorBody), (status = 401, body = ApiErrorBody)))]
pub async fn drift(
    State(state): State<AppState>,
    caller: Caller,
    ApiQuery(params): ApiQuery<DriftParams>,
) -> ApiResult<SerializedJson> {
    caller.require(Role::Viewer)?;
    let (run_id, params) = params.split();
    drift_page(&state, params, run_id).await
}

/// Every resume of one run that crossed operational drift. A run another run replaced keeps
/// its history here, as at `/drift?run_id=` (and as its validations).
#[utoipa::path(get, path = "/runs/{run_id}/drift", tag = "drift", params(("run_id" = String, Path, description = "Run id"), RunDriftParams),
    responses((status = 200, body = DriftPage), (status = 404, body = ApiErrorBody), (status = 422, body = ApiErrorBody), (status = 410, body = ApiErrorBody), (status = 401, body = ApiErrorBody)))]
pub async fn run_drift(
    State(state): State<AppState>,
    Path(run_id): Path<String>,
    caller: Caller,
    ApiQuery(params): ApiQuery<RunDriftParams>,
) -> ApiResult<SerializedJson> {
    caller.require(Role::Viewer)?;
    // A superseded run is history too (hostile review 52, F7: the Python client reads a run's
    // drift here, and was refused `run_superseded`).
    state.known_run(&run_id).await?;
    drift_page(&state, params, Some(run_id)).await
}

#[derive(Debug, Clone, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct ClassifyRequest {
    /// Saved result or failure rows.
    #[schema(value_type = Vec<Object>)]
    pub rows: Vec<Value>,
    #[serde(default)]
    pub retry_terminal_timeouts: bool,
    /// A classification policy (default: the shared one).
    #[serde(default)]
    #[schema(value_type = Option<Object>)]
    pub policy: Option<Value>,
}

#[derive(Debug, Clone, Serialize, ToSchema)]
pub struct ClassifyResponse {
    pub decisions: Vec<RowDecision>,
}

/// The classify body as read: each row kept as its raw bytes, read once into the facts the
/// classifier needs (never a `Value` tree per row).
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawClassifyRequest<'a> {
    #[serde(borrow)]
    rows: Vec<&'a serde_json::value::RawValue>,
    #[serde(default)]
    retry_terminal_timeouts: bool,
    #[serde(default, borrow)]
    policy: Option<&'a serde_json::value::RawValue>,
}

/// Classifies a raw batch on this thread and the machine's other cores, in row order; stops
/// early once its caller is gone.
fn classify_batch(body: &[u8], cancel: &crate::state::Cancel) -> ApiResult<Vec<RowDecision>> {
    let request: RawClassifyRequest = crate::error::parse_json_body(body)?;
    if request.rows.len() > CLASSIFY_ROWS {
        return Err(ApiError::new(
            ErrorCode::PayloadTooLarge,
            format!(
                "rows: a classify batch is at most {CLASSIFY_ROWS} rows, this one has {}; send \
                 smaller batches or use the offline `classify` command",
                request.rows.len()
            ),
        ));
    }
    let policy = match request.policy {
        Some(raw) => ClassificationPolicy::from_json(raw.get().as_bytes()).map_err(|e| {
            let said = crate::error::without_quoted_value(e.to_string());
            ApiError::invalid_field("policy", format!("policy: {said}"))
        })?,
        None => ClassificationPolicy::default(),
    };
    let timeouts = request.retry_terminal_timeouts;
    let classify = |offset: usize, rows: &[&serde_json::value::RawValue]| {
        rows.iter()
            .enumerate()
            .map(|(i, raw)| {
                if i % 1024 == 0 && cancel.is_cancelled() {
                    return Err(ApiError::internal("classifying", "the caller went away"));
                }
                match RowFacts::from_line(raw.get().as_bytes()) {
                    Ok(Some(facts)) => Ok(classify_facts(&facts, &policy, timeouts)),
                    Ok(None) => Err(ApiError::invalid_field(
                        &format!("rows[{}]", offset + i),
                        format!("rows[{}]: must be a JSON object", offset + i),
                    )),
                    Err(e) => Err(ApiError::invalid_field(
                        &format!("rows[{}]", offset + i),
                        format!("rows[{}]: {e}", offset + i),
                    )),
                }
            })
            .collect::<ApiResult<Vec<RowDecision>>>()
    };
    let threads = std::thread::available_parallelism().map_or(1, |n| n.get());
    let size = request.rows.len().div_ceil(threads).max(1024);
    std::thread::scope(|scope| {
        let parts: Vec<_> = request
            .rows
            .chunks(size)
            .enumerate()
            .map(|(n, rows)| scope.spawn(move || classify(n * size, rows)))
            .collect();
        let mut decisions = Vec::with_capacity(request.rows.len());
        for part in parts {
            let part = part
                .join()
                .map_err(|_| ApiError::internal("classifying", "a worker panicked"))??;
            decisions.extend(part);
        }
        Ok(decisions)
    })
}

/// The largest classify batch: its answer is many times its size (every predicate of every
/// row), so a batch is bounded well below the body limit; larger files go through the offline
/// `classify` command, which streams.
pub const CLASSIFY_BODY_BYTES: usize = 8 << 20;

/// The most rows of a classify batch: each decision is about 650 bytes whatever its row's size,
/// so tiny rows (`{}`) would otherwise turn 8 MiB into gigabytes of answer.
pub const CLASSIFY_ROWS: usize = 20_000;

/// Classify rows (a batch of at most 8 MiB and 20,000 rows): what every predicate says of each,
/// and what resume does with it.
#[utoipa::path(post, path = "/classify", tag = "classification", request_body = ClassifyRequest,
    responses((status = 200, body = ClassifyResponse), (status = 422, body = ApiErrorBody),
        (status = 413, description = "a batch over 8 MiB or 20,000 rows", body = ApiErrorBody),
        (status = 503, description = "overloaded: retry after Retry-After", body = ApiErrorBody), (status = 401, body = ApiErrorBody)))]
pub async fn classify(
    State(state): State<AppState>,
    caller: Caller,
    ApiJsonBytes(body): ApiJsonBytes,
) -> ApiResult<SerializedJson> {
    caller.require(Role::Viewer)?;
    if body.len() > CLASSIFY_BODY_BYTES {
        return Err(ApiError::new(
            ErrorCode::PayloadTooLarge,
            format!(
                "body: a classify batch is at most {CLASSIFY_BODY_BYTES} bytes, this one is {}; \
                 send smaller batches or use the offline `classify` command",
                body.len()
            ),
        ));
    }
    state
        .heavy
        .run(move |cancel| {
            let decisions = classify_batch(&body, cancel)?;
            SerializedJson::of(&ClassifyResponse { decisions })
        })
        .await
}

/// Which rollouts of a plan to list.
#[derive(Debug, Clone, Deserialize, IntoParams)]
#[serde(deny_unknown_fields)]
#[into_params(parameter_in = Query)]
pub struct PlanParams {
    /// Only rollouts in this state (`scored`, `model_final`, `judge_recoverable`, `retryable`,
    /// `exhausted`, `terminal`, `missing`, `masked`, `omitted`, `awaiting_approval`,
    /// `approved_rerun`).
    #[param(value_type = Option<String>)]
    pub state: Option<PlanState>,
    /// At most this many rollouts (1-1000, default 1000).
    #[param(minimum = 1, maximum = 1000)]
    pub limit: Option<u32>,
    /// Where the previous page ended (its `next_cursor`, which only this run's plan takes).
    #[param(max_length = 64)]
    pub cursor: Option<String>,
}

/// A plan page's cursor: `plan|<run id>|<position>`, the inventory position of the page's last
/// rollout. A position is a place in one run's inventory, so another run's cursor (or another
/// list's) is refused rather than read as an offset (hostile review 54); within the run it may
/// be given with another `state` (the rollouts of that state after the position).
fn plan_cursor(run_id: &str, position: usize) -> String {
    format!("plan|{run_id}|{position}")
}

fn plan_position(run_id: &str, cursor: &str) -> Option<usize> {
    let rest = cursor.strip_prefix("plan|")?.strip_prefix(run_id)?;
    let digits = rest.strip_prefix('|')?;
    // The canonical decimal only (no sign, no leading zero): the text this service wrote.
    digits
        .parse::<usize>()
        .ok()
        .filter(|position| position.to_string() == digits)
}

/// A run's resume plan: the summary (counts per state, coverage) and one page of rollouts in
/// inventory order.
#[derive(Debug, Clone, Serialize, ToSchema)]
pub struct PlanResponse {
    pub run_id: String,
    /// Saved cap (or the default) plus extensions.
    pub cap: u64,
    /// Rollouts per state (over the whole run).
    pub state_counts: BTreeMap<PlanState, u64>,
    /// The coverage snapshot (facts 11.7 fields).
    pub coverage: Coverage,
    pub budget_message: Option<String>,
    pub warnings: Vec<String>,
    /// The collector's completion check over the whole run.
    pub completion: PlanCompletion,
    /// This page's rollouts: state, reason, latest and next attempt.
    pub entries: Vec<PlanEntry>,
    /// Pass as `cursor` for the next page; absent on the last one.
    pub next_cursor: Option<String>,
}

/// The collector's completion check (`IncompleteEvaluationError`): complete when every rollout
/// has its final result or the only gaps are intentional omissions beside completed ones.
#[derive(Debug, Clone, Serialize, ToSchema)]
pub struct PlanCompletion {
    pub complete: bool,
    /// What a collector exits with: 0 complete, 75 progress that a resume continues, 1 no
    /// progress, 76 nothing a resume can run.
    pub exit_code: i32,
    /// Why the run is not complete (or what was accepted).
    pub message: Option<String>,
}

impl PlanCompletion {
    fn of(state_counts: &BTreeMap<PlanState, u64>) -> Self {
        match recovery_core::plan::completion(state_counts) {
            Ok(recovery_core::plan::Completion::Complete) => Self {
                complete: true,
                exit_code: 0,
                message: None,
            },
            Ok(recovery_core::plan::Completion::OnlyIntentionalGaps { omitted }) => Self {
                complete: true,
                exit_code: 0,
                message: Some(format!(
                    "{omitted} rollout(s) intentionally omitted beside completed ones"
                )),
            },
            Err(error) => Self {
                complete: false,
                exit_code: error.exit_code(),
                message: Some(error.message),
            },
        }
    }
}

/// The resume plan: counts per state and coverage over the whole run, and the rollouts paged
/// (optionally of one state). Indexed once per run and caught up with appended outcomes.
#[utoipa::path(get, path = "/runs/{run_id}/plan", tag = "classification", params(("run_id" = String, Path, description = "Run id"), PlanParams),
    responses((status = 200, description = "The plan", body = PlanResponse),
        (status = 404, body = ApiErrorBody), (status = 409, description = "no_manifest", body = ApiErrorBody),
        (status = 422, description = "rows_invalid, manifest_unreadable or invalid_request", body = ApiErrorBody), (status = 401, body = ApiErrorBody),
        (status = 503, description = "overloaded: retry after Retry-After", body = ApiErrorBody)))]
pub async fn plan(
    State(state): State<AppState>,
    Path(run_id): Path<String>,
    caller: Caller,
    ApiQuery(params): ApiQuery<PlanParams>,
) -> ApiResult<SerializedJson> {
    caller.require(Role::Viewer)?;
    let limit = crate::error::page_limit(params.limit, 1000)? as usize;
    let after = match params.cursor.as_deref() {
        None => None,
        Some(text) => Some(plan_position(&run_id, text).ok_or_else(|| {
            ApiError::invalid_field(
                "cursor",
                "cursor: not a cursor this run's plan issued (a plan's cursor continues the \
                 plan of the run it came from)",
            )
        })?),
    };
    let filter = params.state;
    let cursor_run = run_id.clone();
    state
        .with_plan_then(
            &run_id,
            move |plan| {
                let view = plan.view();
                let summary = plan.summary();
                let (positions, more) = summary.positions(filter, after, limit);
                let next_cursor = more
                    .then(|| positions.last().map(|&p| plan_cursor(&cursor_run, p)))
                    .flatten();
                PlanResponse {
                    entries: positions.into_iter().map(|p| view.entry(p)).collect(),
                    next_cursor,
                    completion: PlanCompletion::of(&summary.state_counts),
                    run_id: summary.run_id,
                    cap: summary.cap,
                    state_counts: summary.state_counts,
                    coverage: summary.coverage,
                    budget_message: summary.budget_message,
                    warnings: summary.warnings,
                }
            },
            |page| SerializedJson::of(&page),
        )
        .await?
}
