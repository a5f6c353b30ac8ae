//! Every word list and table the configuration identity uses, as data in one place (the README
//! lists them). Sources: the seed's constants, facts §6-§8 (SRC-v2 lists), decisions §2-§4.

/// Settings that locate or authenticate a server; resolved anew on every start, never identity.
pub const SERVER_RUNTIME_OPTIONS: &[&str] = &[
    "host",
    "port",
    "api_key",
    "openai_api_key",
    "policy_api_key",
    "judge_api_key",
    "tavily_api_key",
    "anthropic_api_key",
    "model_api_key",
    "switchyard_api_key",
    "hf_token",
    "num_workers",
    "base_url",
    "openai_base_url",
    "policy_base_url",
    "judge_base_url",
    "sandbox_model_base_url",
    "model_base_url",
    "vllm_base_url",
    "switchyard_base_url",
    "head_server",
    "disallowed_ports",
    "port_range_low",
    "port_range_high",
    "model_call_capture_dir",
];

/// Collection and output choices that can change between invocations without changing a task.
pub const COLLECTION_OPTIONS: &[&str] = &[
    "resume_from_cache",
    "resubmit",
    "checkpoint_dir",
    "checkpoint_every_s",
    "checkpoint_timeout_s",
    "dispatch_budget_s",
    "drain_margin_s",
    "dispatch_longest_first",
    "retry_terminal_timeouts",
    "retry_invalid_judge_responses",
    "allow_unsafe_resume",
    "output_jsonl_fpath",
    "input_jsonl_fpath",
    "num_samples_in_parallel",
    "max_resident_rollout_tasks",
    "retain_results_in_memory",
    "require_complete",
    "disable_aggregation",
    "disable_health_check",
    "health_check_workers",
    "health_check_ignored_checks",
    "upload_rollouts",
    "count_failure_classes_as_zero",
    "count_missing_rollouts_as_zero",
    "route_failures_to_sidecar",
];

/// Keys that mark a top-level mapping as a server block.
pub const SERVER_KINDS: &[&str] = &[
    "responses_api_agents",
    "responses_api_models",
    "resources_servers",
    "environment_servers",
];

/// Settings holding HTTP headers, where authentication headers are dropped from identity.
pub const HEADER_SETTINGS: &[&str] = &[
    "headers",
    "default_headers",
    "openai_default_headers",
    "artifact_request_headers",
];

/// Authentication header names (compared lower-cased), operational at those settings.
pub const AUTH_HEADERS: &[&str] = &[
    "authorization",
    "proxy-authorization",
    "x-api-key",
    "api-key",
];

/// Keys whose mapping value names a server that must exist.
pub const SERVER_REFERENCE_KEYS: &[&str] = &[
    "model_server",
    "resources_server",
    "agent_server",
    "environment_server",
];

/// Per-implementation resume toggles removed from identity: (kind, implementation, setting).
pub const IMPLEMENTATION_RUNTIME_OPTIONS: &[(&str, &str, &str)] =
    &[("responses_api_agents", "stirrup_agent", "rerun_incomplete")];

/// Capture settings whose `dir` key is operational (top level and per server).
pub const TOKEN_ID_CAPTURE: &str = "token_id_capture";

/// `_REMOVED_NULL_DEFAULTS`: settings whose default is null, keyed by (server kind, implementation).
pub const REMOVED_NULL_DEFAULTS: &[((&str, &str), &[&str])] = &[(
    ("responses_api_models", "vllm_model"),
    &["chat_template_kwargs", "sampling_overrides"],
)];

/// `_LEGACY_SUBSET_LIMIT`: subsets of removed defaults are tried only up to this many names.
pub const LEGACY_SUBSET_LIMIT: usize = 10;

/// `_ADDED_COLLECTION_DEFAULTS`: collection settings added after runs were already recorded.
pub const ADDED_COLLECTION_DEFAULTS: &[(&str, f64)] = &[("dispatch_connect_grace_s", 60.0)];

/// `_REDACTED`: what every credential becomes in the persisted identity.
pub const REDACTED: &str = "<redacted>";

/// Credential-named keys, variables and settings (decisions §3), matched case-insensitively
/// anywhere in the name.
pub const CREDENTIAL_NAME: &str = r"(?i)api_?key|secret|passw(or)?d|credential|private_?key|access_?key|cookie|authorization|(^|[_-])token$|^x-api-key$";

/// `_ASSIGNMENT`: a `NAME=value` string.
pub const ASSIGNMENT: &str = r"(?s)^([A-Za-z_][A-Za-z0-9_]*)=(.+)$";

/// `_HTTP_CREDENTIAL`: an HTTP Bearer/Basic credential.
pub const HTTP_CREDENTIAL: &str = r"(?i)^(bearer|basic)\s+\S+$";

/// `_ENV_REFERENCE`: an environment interpolation and its variable name.
pub const ENV_REFERENCE: &str = r"\$\{oc\.env:\s*([A-Za-z_][A-Za-z0-9_]*)[^{}]*\}";

/// `_CONFIG_REFERENCE`: a configuration interpolation and its dotted path.
pub const CONFIG_REFERENCE: &str = r"\$\{([A-Za-z_][\w.\-]*)\}";

/// A URL (scheme `://` and everything up to whitespace). It holds a password when its authority
/// (up to the first `/`, `?` or `#`) has user information (`@`) with a `:`; the password then
/// runs to the URL's last `@` (a password may hold `@` and `/` unencoded: `postgres://u:p@ss/word@h`
/// hides `p@ss/word`; hiding too much is safe, showing a piece of a password is not).
pub const URL_PASSWORD: &str = r"[A-Za-z][A-Za-z0-9+.\-]*://\S+";

/// Runtime reference occurrences examined by `_normalize_runtime_references` (SRC-v2 pattern).
pub const RUNTIME_REFERENCE: &str = r"\$\{([^{}]+)\}";
