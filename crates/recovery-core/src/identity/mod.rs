//! Configuration identity: the configuration a run's results depend on, compared on resume.
//!
//! Pipeline (facts §5-§8, decisions §2-§4), on the collector's `config`, raw `global_config`,
//! materialized rows (only their server references) and `environment` map:
//! 1. runtime references normalised (`${policy_base_url}` -> `<runtime:policy_base_url>`);
//! 2. current form only: credentials redacted, before anything is resolved;
//! 3. runtime options, collection options, auth headers, Stirrup's resume toggle and capture dirs
//!    removed at known configuration boundaries;
//! 4. reachable servers selected from the rows and resolved (OmegaConf subset) with the root as
//!    context, a selected block swapped for its filtered form; unused servers never resolved;
//! 5. collection part and `token_id_capture` (without `dir`) resolved;
//! 6. current form only: null settings whose default is null dropped, then credentials redacted
//!    once more (an interpolation may have brought one in from a non-credential-named key).
//!
//! The legacy form (no redaction, no null-default removal) is what pre-0.5.0 Gyms digested; it is
//! only ever computed in memory to recognise such runs, never stored or logged.

pub mod interpolation;
pub mod redaction;
pub mod tables;

use crate::canonical::{CanonicalError, digest};
use interpolation::{InterpolationError, Resolver, Segment, lookup_mut};
use redaction::{credential_safe, normalize_runtime_references};
use serde_json::{Map, Number, Value};
use std::collections::{BTreeMap, BTreeSet};
use tables::{
    ADDED_COLLECTION_DEFAULTS, AUTH_HEADERS, COLLECTION_OPTIONS, HEADER_SETTINGS,
    IMPLEMENTATION_RUNTIME_OPTIONS, LEGACY_SUBSET_LIMIT, REMOVED_NULL_DEFAULTS, SERVER_KINDS,
    SERVER_REFERENCE_KEYS, SERVER_RUNTIME_OPTIONS, TOKEN_ID_CAPTURE,
};

/// Which identity form to compute.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum IdentityForm {
    /// 0.5.0 and later: credentials redacted, null defaults dropped. Saved beside the manifest.
    Current,
    /// Pre-0.5.0 (`credential_safe=False`): compared in memory only.
    Legacy,
}

/// Why a configuration has no identity.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum IdentityError {
    #[error("Cannot verify run identity: running configuration is missing servers [{}].", quote_list(.0))]
    MissingServers(Vec<String>),
    #[error("Cannot verify run identity: running configuration is missing server '{}'.", redaction::redact_string(.0))]
    MissingServer(String),
    #[error(transparent)]
    Interpolation(#[from] InterpolationError),
    #[error("{field}: {message}")]
    Invalid { field: String, message: String },
    #[error("the identity has no canonical form: {0}")]
    Canonical(#[from] CanonicalError),
}

impl IdentityError {
    /// Stable class name (`missing_server`, `interpolation`, `invalid_input`, `canonical`).
    pub fn kind(&self) -> &'static str {
        match self {
            Self::MissingServers(_) | Self::MissingServer(_) => "missing_server",
            Self::Interpolation(_) => "interpolation",
            Self::Invalid { .. } => "invalid_input",
            Self::Canonical(_) => "canonical",
        }
    }
}

/// Server names as the reference's message lists them, each through the redaction its values
/// get: a name read from a row or interpolated from the environment is request text, and
/// refusals are recorded.
fn quote_list(names: &[String]) -> String {
    names
        .iter()
        .map(|n| format!("'{}'", redaction::redact_string(n)))
        .collect::<Vec<_>>()
        .join(", ")
}

/// The server references of materialized rows: all the identity needs of them, so rows can be
/// streamed from a file instead of held in memory.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct RowReferences {
    /// `agent_ref.name` of every row.
    pub agents: BTreeSet<String>,
    /// Truthy `_ng_environment_server` of every row.
    pub environment_servers: BTreeSet<String>,
    /// `agent_ref.name` of rows without an Environment Server (wrapped by one at dispatch).
    pub legacy_agents: BTreeSet<String>,
    /// String `task_source` of every row.
    pub task_sources: BTreeSet<String>,
}

impl RowReferences {
    pub fn from_rows<'a>(rows: impl IntoIterator<Item = &'a Value>) -> Self {
        let mut refs = Self::default();
        for row in rows {
            refs.add_row(row);
        }
        refs
    }

    /// [`Self::add_row`] of one row's raw JSON text, reading only the fields references come
    /// from (the rest is skipped, never built into a tree).
    pub fn add_raw_row(&mut self, text: &[u8]) -> Result<(), String> {
        #[derive(serde::Deserialize)]
        struct Referenced {
            #[serde(default)]
            agent_ref: Option<Value>,
            #[serde(default)]
            _ng_environment_server: Option<Value>,
            #[serde(default)]
            task_source: Option<Value>,
        }
        let row = match serde_json::from_slice::<Referenced>(text) {
            Ok(fields) => {
                let mut row = Map::new();
                for (key, value) in [
                    ("agent_ref", fields.agent_ref),
                    ("_ng_environment_server", fields._ng_environment_server),
                    ("task_source", fields.task_source),
                ] {
                    if let Some(value) = value {
                        row.insert(key.into(), value);
                    }
                }
                Value::Object(row)
            }
            // A repeated key (the last wins, as in Python) or an odd shape: read it all.
            Err(_) => serde_json::from_slice(text).map_err(|e| e.to_string())?,
        };
        self.add_row(&row);
        Ok(())
    }

    pub fn add_row(&mut self, row: &Value) {
        let agent = match row.get("agent_ref") {
            Some(Value::Object(agent)) => agent.get("name").filter(|n| !n.is_null()).map(name_text),
            _ => None,
        };
        let environment = row
            .get("_ng_environment_server")
            .filter(|v| truthy(v))
            .map(name_text);
        if let Some(agent) = &agent {
            self.agents.insert(agent.clone());
            if environment.is_none() {
                self.legacy_agents.insert(agent.clone());
            }
        }
        if let Some(environment) = environment {
            self.environment_servers.insert(environment);
        }
        if let Some(Value::String(source)) = row.get("task_source") {
            self.task_sources.insert(source.clone());
        }
    }
}

/// A row's server name as text; a name that is not a string (never a server's) is written
/// redacted, since it is only ever shown in a refusal.
fn name_text(value: &Value) -> String {
    match value {
        Value::String(s) => s.clone(),
        other => redaction::credential_safe(other, false).to_string(),
    }
}

/// Python truthiness of a JSON value.
pub fn truthy(value: &Value) -> bool {
    match value {
        Value::Null => false,
        Value::Bool(b) => *b,
        Value::Number(n) => {
            let text = n.to_string();
            text.parse::<f64>() != Ok(0.0)
        }
        Value::String(s) => !s.is_empty(),
        Value::Array(a) => !a.is_empty(),
        Value::Object(o) => !o.is_empty(),
    }
}

/// Everything a configuration identity is computed from.
#[derive(Debug, Clone, Copy)]
pub struct ConfigBundle<'a> {
    /// Collection settings (the run's collection config dump).
    pub config: &'a Value,
    /// The raw server configuration tree, interpolations unresolved.
    pub global_config: &'a Value,
    /// Server references of the materialized rows.
    pub rows: &'a RowReferences,
    /// Environment variables the collector chose to send (never the process environment).
    pub environment: &'a BTreeMap<String, String>,
}

/// Whether a setting's value is text that interpolates (`${...}`): only such a value needs the
/// server tree and the environment to be read ([`resolved_collection_setting`]).
pub fn holds_interpolation(value: &Value) -> bool {
    value.as_str().is_some_and(|text| text.contains("${"))
}

/// A collection setting the identity leaves out (one of the `COLLECTION_OPTIONS`, such as
/// `retry_terminal_timeouts`) as the collector's configuration resolves it: runtime references
/// normalised and credentials redacted as for the identity, then its interpolations resolved
/// against the server tree, the other collection settings and the environment sent
/// (`${oc.env:NAME,default}`, `${path}`). `None` when `config` does not set it. A value with no
/// interpolation is returned as it is.
pub fn resolved_collection_setting(
    bundle: &ConfigBundle<'_>,
    key: &str,
) -> Result<Option<Value>, IdentityError> {
    let Some(value) = bundle.config.get(key) else {
        return Ok(None);
    };
    if !holds_interpolation(value) {
        return Ok(Some(value.clone()));
    }
    let mut context = credential_safe(&normalize_runtime_references(bundle.global_config), false);
    let settings = credential_safe(&normalize_runtime_references(bundle.config), false);
    const SETTINGS_KEY: &str = "_collection_settings";
    let Value::Object(root) = &mut context else {
        return Err(IdentityError::Invalid {
            field: "global_config".into(),
            message: "must be a JSON object".into(),
        });
    };
    root.insert(SETTINGS_KEY.into(), settings);
    let resolved = Resolver::new(bundle.environment)
        .resolve_at(
            &context,
            &[Segment::Key(SETTINGS_KEY.into()), Segment::Key(key.into())],
        )
        .map_err(|e| e.rooted_at(SETTINGS_KEY, "config"))?;
    Ok(Some(resolved))
}

/// `_configuration_identity(config, global_config, rows, credential_safe)`.
pub fn configuration_identity(
    bundle: ConfigBundle<'_>,
    form: IdentityForm,
) -> Result<Value, IdentityError> {
    let Value::Object(config) = bundle.config else {
        return Err(IdentityError::Invalid {
            field: "config".into(),
            message: "must be a JSON object".into(),
        });
    };
    if !bundle.global_config.is_object() {
        return Err(IdentityError::Invalid {
            field: "global_config".into(),
            message: "must be a JSON object".into(),
        });
    }
    let redact = form == IdentityForm::Current;
    let mut raw = normalize_runtime_references(bundle.global_config);
    if redact {
        raw = credential_safe(&raw, false);
    }
    let filtered = without_runtime_options(&raw);
    let servers: BTreeSet<String> = raw
        .as_object()
        .map(|root| {
            root.iter()
                .filter(|(_, block)| {
                    block
                        .as_object()
                        .is_some_and(|b| SERVER_KINDS.iter().any(|k| b.contains_key(*k)))
                })
                .map(|(name, _)| name.clone())
                .collect()
        })
        .unwrap_or_default();
    let mut context = raw.clone();
    let mut resolver = Resolver::new(bundle.environment);

    let mut pending: BTreeSet<String> = bundle.rows.agents.clone();
    pending.extend(bundle.rows.environment_servers.iter().cloned());
    if !bundle.rows.legacy_agents.is_empty() {
        for name in &servers {
            let Some(Value::Object(implementations)) =
                raw.get(name).and_then(|b| b.get("environment_servers"))
            else {
                continue;
            };
            for implementation in implementations.keys() {
                let path = key_path(&[name, "environment_servers", implementation, "agent_server"]);
                let Some(reference) = raw.pointer(&pointer(&path)) else {
                    continue;
                };
                // Match dispatch's resolved reference without resolving unrelated settings.
                let reference = if reference.is_string() {
                    resolver.resolve_at(&context, &path)?
                } else {
                    reference.clone()
                };
                let Value::Object(reference) = reference else {
                    continue;
                };
                let Some(agent) = reference.get("name") else {
                    continue;
                };
                let mut name_path = path.clone();
                name_path.push(Segment::Key("name".into()));
                let agent = if raw.pointer(&pointer(&name_path)).is_some() {
                    resolver.resolve_at(&context, &name_path)?
                } else {
                    agent.clone()
                };
                if let Value::String(agent) = agent
                    && bundle.rows.legacy_agents.contains(&agent)
                {
                    pending.insert(name.clone());
                }
            }
        }
    }
    let missing: Vec<String> = pending
        .iter()
        .filter(|n| !servers.contains(*n))
        .cloned()
        .collect();
    if !missing.is_empty() {
        return Err(IdentityError::MissingServers(missing));
    }
    pending.extend(
        bundle
            .rows
            .task_sources
            .iter()
            .filter(|s| servers.contains(*s))
            .cloned(),
    );
    if pending.is_empty() {
        pending = servers.clone();
    }
    let mut selected = Map::new();
    while let Some(name) = pending.pop_first() {
        if selected.contains_key(&name) || !servers.contains(&name) {
            continue;
        }
        let block = filtered.get(&name).cloned().unwrap_or(Value::Null);
        if let Some(slot) = lookup_mut(&mut context, &[Segment::Key(name.clone())]) {
            *slot = block;
        }
        let resolved = resolver.resolve_at(&context, &[Segment::Key(name.clone())])?;
        collect_references(&resolved, false, &servers, &mut pending)?;
        selected.insert(name, resolved);
    }

    let mut collection = Map::new();
    for (key, value) in config {
        if !COLLECTION_OPTIONS.contains(&key.as_str()) {
            collection.insert(key.clone(), value.clone());
        }
    }
    let mut collection = normalize_runtime_references(&Value::Object(collection));
    if redact {
        collection = credential_safe(&collection, false);
    }
    let capture = match raw.get(TOKEN_ID_CAPTURE) {
        None | Some(Value::Null) => Map::new(),
        Some(Value::Object(capture)) => capture
            .iter()
            .filter(|(k, _)| *k != "dir")
            .map(|(k, v)| (k.clone(), v.clone()))
            .collect(),
        Some(_) => {
            return Err(IdentityError::Invalid {
                field: "global_config.token_id_capture".into(),
                message: "must be a mapping".into(),
            });
        }
    };
    const COLLECTION_KEY: &str = "_collection_identity";
    const CAPTURE_KEY: &str = "_capture_identity";
    if let Value::Object(root) = &mut context {
        root.insert(COLLECTION_KEY.into(), collection);
        root.insert(CAPTURE_KEY.into(), Value::Object(capture));
    }
    // The two trees are resolved in place under keys of ours; an error names the key as the
    // sender wrote it.
    let collection = resolver
        .resolve_at(&context, &[Segment::Key(COLLECTION_KEY.into())])
        .map_err(|e| e.rooted_at(COLLECTION_KEY, "config"))?;
    let capture = resolver
        .resolve_at(&context, &[Segment::Key(CAPTURE_KEY.into())])
        .map_err(|e| e.rooted_at(CAPTURE_KEY, "global_config.token_id_capture"))?;

    let mut identity = Map::new();
    identity.insert("collection".into(), collection);
    identity.insert("servers".into(), Value::Object(selected));
    identity.insert(TOKEN_ID_CAPTURE.into(), capture);
    let mut identity = Value::Object(identity);
    if form == IdentityForm::Current {
        // Interpolation can bring a credential in from the environment (`${oc.env:URL}` holding
        // `https://u:secret@host`): what the identity persists is redacted once more after it.
        identity = credential_safe(&without_null_defaults(&identity), false);
    }
    Ok(identity)
}

/// The JSON pointer of a dotted key (as [`crate::drift::differing_keys`] names them).
fn key_pointer(key: &str) -> String {
    key.split('.').fold(String::new(), |mut out, segment| {
        out.push('/');
        out.push_str(&segment.replace('~', "~0").replace('/', "~1"));
        out
    })
}

fn key_path(keys: &[&str]) -> Vec<Segment> {
    keys.iter().map(|k| Segment::Key((*k).to_owned())).collect()
}

/// JSON pointer of a key path (for read-only lookups in the raw tree).
fn pointer(path: &[Segment]) -> String {
    path.iter()
        .map(|s| match s {
            Segment::Key(k) => format!("/{}", k.replace('~', "~0").replace('/', "~1")),
            Segment::Index(i) => format!("/{i}"),
        })
        .collect()
}

/// Adds the servers a resolved block references; a reference at a server-reference key or with a
/// server `type` must name an existing server.
fn collect_references(
    value: &Value,
    server_reference: bool,
    servers: &BTreeSet<String>,
    pending: &mut BTreeSet<String>,
) -> Result<(), IdentityError> {
    match value {
        Value::Object(map) => {
            if let Some(Value::String(name)) = map.get("name") {
                let typed = matches!(map.get("type"), Some(Value::String(t)) if SERVER_KINDS.contains(&t.as_str()));
                if (server_reference || typed) && !servers.contains(name) {
                    return Err(IdentityError::MissingServer(name.clone()));
                }
                if servers.contains(name) {
                    pending.insert(name.clone());
                }
            }
            for (key, item) in map {
                collect_references(
                    item,
                    SERVER_REFERENCE_KEYS.contains(&key.as_str()),
                    servers,
                    pending,
                )?;
            }
        }
        Value::Array(items) => {
            for item in items {
                collect_references(item, server_reference, servers, pending)?;
            }
        }
        _ => {}
    }
    Ok(())
}

/// `_without_runtime_options`: the raw root without runtime and collection options, at known
/// configuration boundaries only (nested task data keeps keys named `port` or `api_key`).
pub fn without_runtime_options(root: &Value) -> Value {
    let Value::Object(root) = root else {
        return root.clone();
    };
    let mut result = Map::new();
    for (name, block) in root {
        if SERVER_RUNTIME_OPTIONS.contains(&name.as_str())
            || COLLECTION_OPTIONS.contains(&name.as_str())
        {
            continue;
        }
        let Value::Object(block) = block else {
            result.insert(name.clone(), block.clone());
            continue;
        };
        let mut updated = block.clone();
        for kind in SERVER_KINDS {
            if let Some(Value::Object(implementations)) = block.get(*kind) {
                let filtered: Map<String, Value> = implementations
                    .iter()
                    .map(|(implementation, settings)| {
                        (
                            implementation.clone(),
                            settings_identity(settings, kind, implementation),
                        )
                    })
                    .collect();
                updated.insert((*kind).to_owned(), Value::Object(filtered));
            }
        }
        result.insert(name.clone(), Value::Object(updated));
    }
    Value::Object(result)
}

fn settings_identity(settings: &Value, kind: &str, implementation: &str) -> Value {
    let Value::Object(settings) = settings else {
        return settings.clone();
    };
    let mut out: Map<String, Value> = settings
        .iter()
        .filter(|(k, _)| !SERVER_RUNTIME_OPTIONS.contains(&k.as_str()))
        .map(|(k, v)| (k.clone(), v.clone()))
        .collect();
    for (k, i, setting) in IMPLEMENTATION_RUNTIME_OPTIONS {
        if *k == kind && *i == implementation {
            out.shift_remove(*setting);
        }
    }
    for name in HEADER_SETTINGS {
        if let Some(Value::Object(headers)) = out.get(*name) {
            let kept: Map<String, Value> = headers
                .iter()
                .filter(|(header, _)| !AUTH_HEADERS.contains(&header.to_lowercase().as_str()))
                .map(|(k, v)| (k.clone(), v.clone()))
                .collect();
            out.insert((*name).to_owned(), Value::Object(kept));
        }
    }
    if let Some(Value::Object(capture)) = out.get(TOKEN_ID_CAPTURE) {
        let kept: Map<String, Value> = capture
            .iter()
            .filter(|(k, _)| *k != "dir")
            .map(|(k, v)| (k.clone(), v.clone()))
            .collect();
        out.insert(TOKEN_ID_CAPTURE.to_owned(), Value::Object(kept));
    }
    Value::Object(out)
}

/// Settings mappings of every selected server whose (kind, implementation) has removed null
/// defaults, with the names listed for it.
fn null_default_sites(identity: &Value) -> Vec<(Vec<Segment>, &'static [&'static str])> {
    let mut sites = Vec::new();
    let Some(Value::Object(servers)) = identity.get("servers") else {
        return sites;
    };
    for (name, block) in servers {
        for ((kind, implementation), names) in REMOVED_NULL_DEFAULTS {
            if block
                .get(*kind)
                .and_then(|k| k.get(*implementation))
                .is_some_and(Value::is_object)
            {
                sites.push((key_path(&["servers", name, kind, implementation]), *names));
            }
        }
    }
    sites
}

/// `_without_null_defaults`: drops listed settings whose value is null (null and absent are the
/// same there); elsewhere null is a value of its own and stays.
pub fn without_null_defaults(identity: &Value) -> Value {
    let mut out = identity.clone();
    for (path, names) in null_default_sites(identity) {
        if let Some(Value::Object(settings)) = lookup_mut(&mut out, &path) {
            for name in names {
                if settings.get(*name).is_some_and(Value::is_null) {
                    settings.shift_remove(*name);
                }
            }
        }
    }
    out
}

/// The identity with null defaults restored per concrete server path, one form per subset of
/// the names some server lacks (all-or-none beyond [`LEGACY_SUBSET_LIMIT`] names).
fn null_default_restorations(identity: &Value) -> Vec<Value> {
    let sites = null_default_sites(identity);
    let mut lacking: Vec<&str> = Vec::new();
    for (path, names) in &sites {
        let settings = path_get(identity, path);
        for name in *names {
            if settings.is_some_and(|s| s.get(*name).is_none()) && !lacking.contains(name) {
                lacking.push(name);
            }
        }
    }
    let subsets: Vec<Vec<&str>> = if lacking.len() <= LEGACY_SUBSET_LIMIT {
        (0..1usize << lacking.len())
            .map(|mask| {
                lacking
                    .iter()
                    .enumerate()
                    .filter(|(i, _)| mask & (1 << i) != 0)
                    .map(|(_, n)| *n)
                    .collect()
            })
            .collect()
    } else {
        vec![Vec::new(), lacking.clone()]
    };
    subsets
        .into_iter()
        .map(|subset| {
            let mut form = identity.clone();
            for (path, _) in &sites {
                if let Some(Value::Object(settings)) = lookup_mut(&mut form, path) {
                    for name in &subset {
                        // Never over a value this server sets.
                        settings.entry((*name).to_owned()).or_insert(Value::Null);
                    }
                }
            }
            form
        })
        .collect()
}

fn path_get<'v>(value: &'v Value, path: &[Segment]) -> Option<&'v Value> {
    value.pointer(&pointer(path))
}

/// `_earlier_collection_forms`: the identity as it is, without each added collection setting
/// (a Gym before it existed), with it at its default, and at the value this configuration sets.
fn earlier_collection_forms(identity: &Value, config: &Value) -> Vec<Value> {
    let mut forms = vec![identity.clone()];
    for (setting, default) in ADDED_COLLECTION_DEFAULTS {
        let mut next = Vec::new();
        for form in &forms {
            next.push(form.clone());
            let variants = [
                None,
                Number::from_f64(*default).map(Value::Number),
                config.get(*setting).cloned(),
            ];
            for variant in variants
                .iter()
                .enumerate()
                .filter(|(i, v)| *i == 0 || v.is_some())
                .map(|(_, v)| v)
            {
                let mut changed = form.clone();
                if let Some(Value::Object(collection)) = changed.get_mut("collection") {
                    match variant {
                        None => {
                            collection.shift_remove(*setting);
                        }
                        Some(value) => {
                            collection.insert((*setting).to_owned(), value.clone());
                        }
                    }
                }
                next.push(changed);
            }
        }
        forms = next;
    }
    forms
}

/// A configuration's identity in every form a resume may compare against.
#[derive(Clone)]
pub struct ConfigurationIdentity {
    /// The current form: what `config_digest` is taken of and what is saved beside the manifest.
    pub identity: Value,
    /// `_digest(identity)`.
    pub config_digest: String,
    /// Digest of the pre-0.5.0 form, when it could be computed.
    pub legacy_digest: Option<String>,
    /// Every digest that names this configuration in an earlier recorded form.
    accepted: BTreeSet<String>,
}

impl std::fmt::Debug for ConfigurationIdentity {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ConfigurationIdentity")
            .field("config_digest", &self.config_digest)
            .field("legacy_digest", &self.legacy_digest)
            .field("accepted_forms", &self.accepted.len())
            .finish_non_exhaustive()
    }
}

impl ConfigurationIdentity {
    /// Computes the current form and every earlier form of a configuration.
    pub fn compute(bundle: ConfigBundle<'_>) -> Result<Self, IdentityError> {
        let mut identity = Self::compute_current(bundle)?;
        identity.add_earlier_forms(bundle)?;
        Ok(identity)
    }

    /// Computes the current form only: enough when the saved digest is the current one (the
    /// common resume), which [`Self::matches_config`] then accepts. Earlier forms are added by
    /// [`Self::add_earlier_forms`] when it does not match.
    pub fn compute_current(bundle: ConfigBundle<'_>) -> Result<Self, IdentityError> {
        let identity = configuration_identity(bundle, IdentityForm::Current)?;
        let config_digest = digest(&identity)?;
        Ok(Self {
            accepted: BTreeSet::from([config_digest.clone()]),
            identity,
            config_digest,
            legacy_digest: None,
        })
    }

    /// Adds the legacy form and every earlier recorded form of the same bundle.
    pub fn add_earlier_forms(&mut self, bundle: ConfigBundle<'_>) -> Result<(), IdentityError> {
        // A legacy form that cannot be computed (e.g. a credential variable it would have read
        // is absent) simply names no earlier run.
        let legacy = configuration_identity(bundle, IdentityForm::Legacy).ok();
        let legacy_digest = legacy.as_ref().map(digest).transpose()?;
        let mut bases = vec![self.identity.clone()];
        if let Some(legacy) = &legacy {
            bases.push(without_null_defaults(legacy));
        }
        for base in &bases {
            for restored in null_default_restorations(base) {
                for form in earlier_collection_forms(&restored, bundle.config) {
                    self.accepted.insert(digest(&form)?);
                }
            }
        }
        self.accepted.extend(legacy_digest.iter().cloned());
        self.legacy_digest = legacy_digest;
        Ok(())
    }

    /// Whether an earlier form of this configuration could be `saved`, the identity saved beside
    /// a manifest whose digest is `saved_digest` (when the current form is not). Every earlier
    /// form differs from the current one only where [`add_earlier_forms`](Self::add_earlier_forms)
    /// changes it: a removed null default (a key segment named in `REMOVED_NULL_DEFAULTS`), an
    /// added collection setting (`ADDED_COLLECTION_DEFAULTS`), or a value the current form
    /// redacted (it holds `<redacted>`). A verified saved identity that differs from the current
    /// form in any other key is no earlier form, and they need not be computed: a resume across
    /// drift (a changed port) then costs one identity, not every form. An unverified saved
    /// identity (its digest is not `saved_digest`) proves nothing: `true`.
    pub fn earlier_form_could_be(&self, saved: &Value, saved_digest: &str) -> bool {
        if digest(saved).ok().as_deref() != Some(saved_digest) {
            return true;
        }
        let changed_by_a_form = |key: &str| {
            let named = key.split('.').any(|segment| {
                REMOVED_NULL_DEFAULTS
                    .iter()
                    .any(|(_, names)| names.contains(&segment))
                    || ADDED_COLLECTION_DEFAULTS
                        .iter()
                        .any(|(name, _)| *name == segment)
            });
            let pointer = key_pointer(key);
            match (self.identity.pointer(&pointer), saved.pointer(&pointer)) {
                // A key holding `.` cannot be found again from its dotted name: no proof.
                (None, None) => true,
                (current, saved) => {
                    named
                        || [current, saved]
                            .into_iter()
                            .flatten()
                            .any(|v| v.to_string().contains(tables::REDACTED))
                }
            }
        };
        crate::drift::differing_keys(saved, &self.identity)
            .iter()
            .all(|key| changed_by_a_form(key))
    }

    /// `RunManifest.matches_config(saved_digest)`: whether a saved digest names this
    /// configuration, in this or an earlier recorded form.
    pub fn matches_config(&self, saved_digest: &str) -> bool {
        self.accepted.contains(saved_digest)
    }

    /// Number of distinct digests accepted (current and earlier forms).
    pub fn accepted_forms(&self) -> usize {
        self.accepted.len()
    }
}
