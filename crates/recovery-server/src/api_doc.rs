//! What the OpenAPI document says of every operation beyond its handler's own annotations: the
//! answers any route can give (the layers around the handlers, authentication, a superseded run)
//! and the links from a created run and a granted lease to the calls that use them.
//!
//! Invariant: a status a route can answer is documented on it (schemathesis checks this in CI
//! with `status_code_conformance`), and every error answer is `ApiErrorBody`.

use utoipa::openapi::path::Operation;
use utoipa::openapi::response::ResponseBuilder;
use utoipa::openapi::security::SecurityRequirement;
use utoipa::openapi::{Content, OpenApi, Ref, RefOr};

/// Routes any client may call without a token.
pub(crate) const OPEN_ROUTES: [&str; 4] = ["/healthz", "/readyz", "/metrics", "/openapi.json"];

/// Answers every authenticated route can give, with the codes behind them.
const EVERY_ROUTE: [(&str, &str); 7] = [
    (
        "401",
        "unauthenticated: the bearer token is missing or unknown",
    ),
    ("403", "forbidden: the caller's role may not do this"),
    (
        "408",
        "request_timeout: the request took longer than RR_REQUEST_TIMEOUT_SECS",
    ),
    ("414", "uri_too_long: the request target is over 8 KiB"),
    ("431", "headers_too_large: the headers are over 64 KiB"),
    (
        "500",
        "internal: the service failed; nothing was half-written",
    ),
    (
        "503",
        "overloaded (retry after Retry-After) or the database does not answer",
    ),
];

/// Answers of a route that reads a body or query parameters.
const WITH_INPUT: [(&str, &str); 2] = [
    (
        "413",
        "payload_too_large: the body is over RR_BODY_LIMIT_MB",
    ),
    (
        "422",
        "invalid_request: a malformed body or parameter, naming the field",
    ),
];

/// Answers of a route about one run.
const ON_A_RUN: [(&str, &str); 2] = [
    ("404", "not_found: no such run"),
    (
        "409",
        "run_superseded (another run owns the output now) or another conflict of the run",
    ),
];

#[derive(Debug)]
pub struct CommonResponses;

impl utoipa::Modify for CommonResponses {
    fn modify(&self, openapi: &mut OpenApi) {
        for (path, item) in &mut openapi.paths.paths {
            let operations = [
                &mut item.get,
                &mut item.post,
                &mut item.delete,
                &mut item.put,
                &mut item.patch,
            ];
            for operation in operations.into_iter().flatten() {
                if OPEN_ROUTES.contains(&path.as_str()) {
                    // An empty requirement: no token needed.
                    operation.security = Some(vec![SecurityRequirement::default()]);
                    continue;
                }
                document(operation, &EVERY_ROUTE);
                let takes_input = operation.request_body.is_some()
                    || operation
                        .parameters
                        .iter()
                        .flatten()
                        .any(|p| p.parameter_in == utoipa::openapi::path::ParameterIn::Query);
                if takes_input {
                    document(operation, &WITH_INPUT);
                }
                if path.contains("{run_id}") {
                    document(operation, &ON_A_RUN);
                }
            }
        }
    }
}

/// Adds each answer the operation does not document yet, as an `ApiErrorBody`.
fn document(operation: &mut Operation, answers: &[(&str, &str)]) {
    for (status, description) in answers {
        operation
            .responses
            .responses
            .entry((*status).to_owned())
            .or_insert_with(|| {
                RefOr::T(
                    ResponseBuilder::new()
                        .description(*description)
                        .content(
                            "application/json",
                            Content::new(Some(Ref::from_schema_name("ApiErrorBody"))),
                        )
                        .build(),
                )
            });
    }
}

/// Links from a created run (its `run_id`) and a granted lease (its `lease_id`) to the calls that
/// take them, so that a generated client and a stateful test know the order of a session.
#[derive(Debug)]
pub struct Links;

impl utoipa::Modify for Links {
    fn modify(&self, openapi: &mut OpenApi) {
        let run_id = "$response.body#/run_id";
        let from_run = [
            "get_run",
            "validate",
            "acquire",
            "holder",
            "plan",
            "run_drift",
            "list_approvals",
        ];
        link(openapi, "/runs", "201", &from_run, run_id, None);
        let lease_id = serde_json::json!({"lease_id": "$response.body#/lease_id"});
        link(
            openapi,
            "/runs/{run_id}/lease",
            "201",
            &["heartbeat", "release"],
            "$request.path.run_id",
            Some(lease_id),
        );
    }
}

fn link(
    openapi: &mut OpenApi,
    path: &str,
    status: &str,
    targets: &[&str],
    run_id: &str,
    body: Option<serde_json::Value>,
) {
    let Some(operation) = openapi
        .paths
        .paths
        .get_mut(path)
        .and_then(|item| item.post.as_mut())
    else {
        return;
    };
    let Some(RefOr::T(response)) = operation.responses.responses.get_mut(status) else {
        return;
    };
    for target in targets {
        let link = utoipa::openapi::link::LinkBuilder::new()
            .operation_id(*target)
            .parameter("run_id", run_id)
            .request_body(body.clone())
            .build();
        response.links.insert((*target).to_owned(), RefOr::T(link));
    }
}

/// Renames the snake-case fields utoipa writes in link objects to the spec's camel case.
pub fn fix_link_field_names(doc: &mut serde_json::Value) {
    let Some(paths) = doc.get_mut("paths").and_then(|p| p.as_object_mut()) else {
        return;
    };
    let responses = paths
        .values_mut()
        .filter_map(|item| item.as_object_mut())
        .flat_map(|item| item.values_mut())
        .filter_map(|operation| operation.get_mut("responses"))
        .filter_map(|responses| responses.as_object_mut())
        .flat_map(|responses| responses.values_mut());
    for response in responses {
        let Some(links) = response.get_mut("links").and_then(|l| l.as_object_mut()) else {
            continue;
        };
        for link in links.values_mut().filter_map(|l| l.as_object_mut()) {
            for (from, to) in [
                ("operation_id", "operationId"),
                ("request_body", "requestBody"),
            ] {
                if let Some(value) = link.remove(from) {
                    link.insert(to.to_owned(), value);
                }
            }
        }
    }
}
