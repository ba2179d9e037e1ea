//! The OpenAPI document served at `GET /openapi.json` (SPEC §13), built with `utoipa`.
//!
//! The derive supplies the document shell; [`RouteTable`] adds one operation per route of
//! `routes::configure` (same methods and paths), the bearer security scheme and the error
//! envelope `{"error":{"code","message"}}`. Keep [`ROUTES`] in step with the route table.

use actix_web::HttpResponse;
use utoipa::openapi::path::{HttpMethod, OperationBuilder, ParameterBuilder, ParameterIn};
use utoipa::openapi::request_body::RequestBodyBuilder;
use utoipa::openapi::schema::{ArrayBuilder, KnownFormat, ObjectBuilder, SchemaFormat, Type};
use utoipa::openapi::security::{HttpAuthScheme, HttpBuilder, SecurityRequirement, SecurityScheme};
use utoipa::openapi::{Components, Content, Ref, RefOr, Required, ResponseBuilder, Schema};
use utoipa::{Modify, OpenApi};

/// The document (OpenAPI 3.1).
#[derive(OpenApi)]
#[openapi(
    info(title = "agentloop", description = "agentloop HTTP API: threads, chat commands, reads, SSE and long-poll"),
    modifiers(&RouteTable)
)]
pub struct ApiDoc;

/// `GET /openapi.json` (no auth).
pub async fn openapi_json() -> HttpResponse {
    HttpResponse::Ok().json(ApiDoc::openapi())
}

const BEARER: &str = "bearer";
const ERROR: &str = "Error";

#[derive(Clone, Copy)]
enum Kind {
    Str,
    Int,
    Bool,
    DateTime,
    /// A JSON object with any members.
    Obj,
    /// Any JSON value (message content: a string or an array of parts).
    Any,
    /// An array of JSON objects.
    Objs,
}

#[derive(Clone, Copy)]
enum Out {
    Json,
    NoContent,
    Sse,
    Text,
    Html,
}

/// A request body: its members (name, kind, required) and whether the body itself is required.
type Body = Option<(&'static [(&'static str, Kind, bool)], bool)>;

struct Route {
    method: HttpMethod,
    path: &'static str,
    id: &'static str,
    tag: &'static str,
    summary: &'static str,
    auth: bool,
    query: &'static [(&'static str, Kind)],
    body: Body,
    ok: (&'static str, &'static str, Out),
    errors: &'static [&'static str],
}

const THREAD_FIELDS: &[(&str, Kind, bool)] = &[("title", Kind::Str, false), ("model", Kind::Str, false), ("metadata", Kind::Obj, false)];
const RUN_OPTIONS: &[(&str, Kind, bool)] = &[("maxSteps", Kind::Int, false), ("model", Kind::Str, false)];

/// Every route of `routes::configure`.
#[rustfmt::skip]
const ROUTES: &[Route] = &[
    Route { method: HttpMethod::Get, path: "/healthz", id: "healthz", tag: "health", summary: "Liveness", auth: false, query: &[], body: None, ok: ("200", "`{\"status\":\"ok\"}`", Out::Json), errors: &[] },
    Route { method: HttpMethod::Get, path: "/readyz", id: "readyz", tag: "health", summary: "Readiness (database reachable)", auth: false, query: &[], body: None, ok: ("200", "`{\"status\":\"ready\"}`", Out::Json), errors: &["503"] },
    Route { method: HttpMethod::Get, path: "/metrics", id: "metrics", tag: "health", summary: "Prometheus metrics", auth: false, query: &[], body: None, ok: ("200", "Prometheus text exposition", Out::Text), errors: &[] },
    Route { method: HttpMethod::Get, path: "/", id: "ui_index", tag: "ui", summary: "Web UI", auth: false, query: &[], body: None, ok: ("200", "The web UI page", Out::Html), errors: &[] },
    Route { method: HttpMethod::Get, path: "/openapi.json", id: "openapi", tag: "meta", summary: "This OpenAPI document", auth: false, query: &[], body: None, ok: ("200", "OpenAPI document", Out::Json), errors: &[] },
    Route { method: HttpMethod::Post, path: "/v1/chat/completions", id: "chat_completions", tag: "openai", summary: "OpenAI-compatible chat completion (non-streaming); other request fields are ignored", auth: true, query: &[],
        body: Some((&[("model", Kind::Str, false), ("messages", Kind::Objs, true), ("stream", Kind::Bool, false)], true)), ok: ("200", "`chat.completion` object", Out::Json), errors: &["400", "401", "413", "502", "504"] },
    Route { method: HttpMethod::Get, path: "/api/models", id: "list_models", tag: "models", summary: "List models", auth: true, query: &[], body: None, ok: ("200", "`{models}`", Out::Json), errors: &["401"] },
    Route { method: HttpMethod::Post, path: "/api/threads", id: "create_thread", tag: "threads", summary: "Create a thread", auth: true, query: &[], body: Some((THREAD_FIELDS, true)), ok: ("201", "The thread", Out::Json), errors: &["400", "401", "413"] },
    Route { method: HttpMethod::Get, path: "/api/threads", id: "list_threads", tag: "threads", summary: "List threads", auth: true, query: &[("limit", Kind::Int), ("cursor", Kind::Str)], body: None, ok: ("200", "`{threads, nextCursor}`", Out::Json), errors: &["400", "401"] },
    Route { method: HttpMethod::Get, path: "/api/threads/{id}", id: "get_thread", tag: "threads", summary: "Get a thread", auth: true, query: &[], body: None, ok: ("200", "The thread", Out::Json), errors: &["401", "404"] },
    Route { method: HttpMethod::Patch, path: "/api/threads/{id}", id: "update_thread", tag: "threads", summary: "Update a thread's title, model or metadata", auth: true, query: &[], body: Some((THREAD_FIELDS, true)), ok: ("200", "The thread", Out::Json), errors: &["400", "401", "404", "413"] },
    Route { method: HttpMethod::Delete, path: "/api/threads/{id}", id: "delete_thread", tag: "threads", summary: "Delete a thread", auth: true, query: &[], body: None, ok: ("204", "Deleted", Out::NoContent), errors: &["401", "404", "409"] },
    Route { method: HttpMethod::Get, path: "/api/threads/{id}/messages", id: "list_messages", tag: "threads", summary: "Page through a thread's messages", auth: true,
        query: &[("before", Kind::Int), ("after", Kind::Int), ("take", Kind::Int), ("maxBytes", Kind::Int)], body: None, ok: ("200", "A page of messages", Out::Json), errors: &["400", "401", "404"] },
    Route { method: HttpMethod::Post, path: "/api/threads/{id}/chat", id: "post_chat", tag: "chat", summary: "Post a user message and enqueue a run (`Idempotency-Key` header or `commandId`)", auth: true, query: &[],
        body: Some((&[("content", Kind::Any, true), ("commandId", Kind::Str, false), ("multitask", Kind::Str, false), ("maxSteps", Kind::Int, false), ("model", Kind::Str, false)], true)),
        ok: ("202", "The message and the run", Out::Json), errors: &["400", "401", "404", "409", "413"] },
    Route { method: HttpMethod::Post, path: "/api/threads/{id}/cancel", id: "cancel_thread", tag: "threads", summary: "Cancel the thread's active and pending runs", auth: true, query: &[], body: None, ok: ("200", "`{runs}`", Out::Json), errors: &["401", "404"] },
    Route { method: HttpMethod::Post, path: "/api/threads/{id}/compact", id: "compact_thread", tag: "threads", summary: "Compact into a new thread", auth: true, query: &[], body: None, ok: ("201", "The new thread and its compaction run", Out::Json), errors: &["401", "404", "409"] },
    Route { method: HttpMethod::Get, path: "/api/threads/{id}/context", id: "get_context", tag: "threads", summary: "The model context of a thread", auth: true, query: &[], body: None, ok: ("200", "The context", Out::Json), errors: &["401", "404"] },
    Route { method: HttpMethod::Post, path: "/api/threads/{id}/messages/{sequence}/edit", id: "edit_message", tag: "messages", summary: "Edit a user message and rerun from it", auth: true, query: &[],
        body: Some((&[("content", Kind::Any, true), ("maxSteps", Kind::Int, false), ("model", Kind::Str, false)], true)), ok: ("202", "The message and the run", Out::Json), errors: &["400", "401", "404", "409", "413"] },
    Route { method: HttpMethod::Post, path: "/api/threads/{id}/messages/{sequence}/regenerate", id: "regenerate_message", tag: "messages", summary: "Regenerate the answer from a message", auth: true, query: &[],
        body: Some((RUN_OPTIONS, false)), ok: ("202", "The run", Out::Json), errors: &["400", "401", "404", "409", "413"] },
    Route { method: HttpMethod::Delete, path: "/api/threads/{id}/messages/{sequence}", id: "delete_message", tag: "messages", summary: "Delete messages from a sequence on", auth: true, query: &[], body: None, ok: ("200", "What was deleted", Out::Json), errors: &["401", "404", "409"] },
    Route { method: HttpMethod::Get, path: "/api/threads/{id}/updates/stream", id: "stream_updates", tag: "updates", summary: "Server-sent events of a thread (`Last-Event-ID` wins over `afterSequence`)", auth: true,
        query: &[("afterSequence", Kind::Int)], body: None, ok: ("200", "An SSE stream", Out::Sse), errors: &["401", "404", "503"] },
    Route { method: HttpMethod::Get, path: "/api/threads/{id}/updates", id: "poll_updates", tag: "updates", summary: "Long-poll a thread's events", auth: true,
        query: &[("afterSequence", Kind::Int), ("timeoutMs", Kind::Int)], body: None, ok: ("200", "`{events, nextSequence, reset}`", Out::Json), errors: &["400", "401", "404", "503"] },
    Route { method: HttpMethod::Get, path: "/api/runs/{id}", id: "get_run", tag: "runs", summary: "Get a run", auth: true, query: &[], body: None, ok: ("200", "The run", Out::Json), errors: &["401", "404"] },
    Route { method: HttpMethod::Post, path: "/api/runs/{id}/cancel", id: "cancel_run", tag: "runs", summary: "Cancel a run", auth: true, query: &[], body: None, ok: ("200", "The run", Out::Json), errors: &["401", "404"] },
    Route { method: HttpMethod::Get, path: "/api/threads/{id}/approvals", id: "list_approvals", tag: "approvals", summary: "List a thread's approvals", auth: true,
        query: &[("status", Kind::Str), ("limit", Kind::Int)], body: None, ok: ("200", "`{approvals}`", Out::Json), errors: &["400", "401", "404"] },
    Route { method: HttpMethod::Post, path: "/api/approvals/{id}/approve", id: "approve_approval", tag: "approvals", summary: "Approve a pending tool call (optionally with edited arguments)", auth: true, query: &[],
        body: Some((&[("arguments", Kind::Obj, false)], false)), ok: ("200", "The approval and its run", Out::Json), errors: &["400", "401", "404", "409", "413"] },
    Route { method: HttpMethod::Post, path: "/api/approvals/{id}/reject", id: "reject_approval", tag: "approvals", summary: "Reject a pending tool call", auth: true, query: &[],
        body: Some((&[("reason", Kind::Str, false)], false)), ok: ("200", "The approval and its run", Out::Json), errors: &["400", "401", "404", "409", "413"] },
    Route { method: HttpMethod::Get, path: "/api/runs/{id}/operations", id: "list_operations", tag: "operations", summary: "A run's tool operations", auth: true, query: &[], body: None, ok: ("200", "`{run, operations}`", Out::Json), errors: &["401", "404"] },
    Route { method: HttpMethod::Post, path: "/api/runs/{id}/operations/{key}/resolve", id: "resolve_operation", tag: "operations", summary: "Resolve an uncertain operation of a blocked run (`completed`, `failed` or `retry`)", auth: true, query: &[],
        body: Some((&[("outcome", Kind::Str, true), ("result", Kind::Str, false), ("reason", Kind::Str, false), ("runUpdatedAt", Kind::DateTime, false)], true)),
        ok: ("200", "`{operation, run}`", Out::Json), errors: &["400", "401", "404", "409", "413"] },
];

fn schema(kind: Kind) -> RefOr<Schema> {
    match kind {
        Kind::Str => ObjectBuilder::new().schema_type(Type::String).into(),
        Kind::Int => ObjectBuilder::new().schema_type(Type::Integer).format(Some(SchemaFormat::KnownFormat(KnownFormat::Int64))).into(),
        Kind::Bool => ObjectBuilder::new().schema_type(Type::Boolean).into(),
        Kind::DateTime => ObjectBuilder::new().schema_type(Type::String).format(Some(SchemaFormat::KnownFormat(KnownFormat::DateTime))).into(),
        Kind::Obj => ObjectBuilder::new().schema_type(Type::Object).into(),
        Kind::Any => ObjectBuilder::new().schema_type(utoipa::openapi::schema::SchemaType::AnyValue).into(),
        Kind::Objs => ArrayBuilder::new().items(ObjectBuilder::new().schema_type(Type::Object)).into(),
    }
}

fn path_param(name: &str) -> RefOr<Schema> {
    match name {
        "sequence" => schema(Kind::Int),
        "key" => schema(Kind::Str),
        _ => ObjectBuilder::new().schema_type(Type::String).format(Some(SchemaFormat::KnownFormat(KnownFormat::Uuid))).into(),
    }
}

fn error_description(status: &str) -> &'static str {
    match status {
        "400" => "Invalid request",
        "401" => "A valid API key is required",
        "404" => "Not found",
        "409" => "Conflict with the current state",
        "413" => "Request body too large",
        "502" => "The run failed",
        "503" => "Unavailable",
        "504" => "Timed out",
        _ => "Error",
    }
}

/// Adds the route table, the bearer scheme and the error envelope to the derived document.
struct RouteTable;

impl Modify for RouteTable {
    fn modify(&self, openapi: &mut utoipa::openapi::OpenApi) {
        let components = openapi.components.get_or_insert_with(Components::default);
        components.add_security_scheme(
            BEARER,
            SecurityScheme::Http(HttpBuilder::new().scheme(HttpAuthScheme::Bearer).description(Some("API key: `Authorization: Bearer <key>`")).build()),
        );
        let envelope = ObjectBuilder::new()
            .schema_type(Type::Object)
            .property(
                "error",
                ObjectBuilder::new()
                    .schema_type(Type::Object)
                    .property("code", schema(Kind::Str))
                    .required("code")
                    .property("message", schema(Kind::Str))
                    .required("message"),
            )
            .required("error");
        components.schemas.insert(ERROR.to_owned(), envelope.into());

        for route in ROUTES {
            let mut op = OperationBuilder::new().operation_id(Some(route.id)).summary(Some(route.summary)).tag(route.tag);
            for name in route.path.split('/').filter_map(|s| s.strip_prefix('{')?.strip_suffix('}')) {
                op = op.parameter(
                    ParameterBuilder::new().name(name).parameter_in(ParameterIn::Path).required(Required::True).schema(Some(path_param(name))),
                );
            }
            for &(name, kind) in route.query {
                op = op.parameter(
                    ParameterBuilder::new().name(name).parameter_in(ParameterIn::Query).required(Required::False).schema(Some(schema(kind))),
                );
            }
            if let Some((fields, required)) = route.body {
                let mut object = ObjectBuilder::new().schema_type(Type::Object);
                for &(name, kind, field_required) in fields {
                    object = object.property(name, schema(kind));
                    if field_required {
                        object = object.required(name);
                    }
                }
                op = op.request_body(Some(
                    RequestBodyBuilder::new()
                        .required(Some(if required { Required::True } else { Required::False }))
                        .content("application/json", Content::new(Some(object)))
                        .build(),
                ));
            }
            let (status, description, out) = route.ok;
            let ok = match out {
                Out::Json => ResponseBuilder::new().description(description).content("application/json", Content::new(Some(schema(Kind::Obj)))),
                Out::NoContent => ResponseBuilder::new().description(description),
                Out::Sse => ResponseBuilder::new().description(description).content("text/event-stream", Content::new(Some(schema(Kind::Str)))),
                Out::Text => ResponseBuilder::new().description(description).content("text/plain", Content::new(Some(schema(Kind::Str)))),
                Out::Html => ResponseBuilder::new().description(description).content("text/html", Content::new(Some(schema(Kind::Str)))),
            };
            op = op.response(status, ok.build());
            for &error in route.errors {
                op = op.response(
                    error,
                    ResponseBuilder::new()
                        .description(error_description(error))
                        .content("application/json", Content::new(Some(Ref::from_schema_name(ERROR))))
                        .build(),
                );
            }
            if route.auth {
                op = op.security(SecurityRequirement::new(BEARER, Vec::<String>::new()));
            }
            openapi.paths.add_path_operation(route.path, vec![route.method.clone()], op.build());
        }
    }
}
