//! The OpenAPI 3.1 document served at `GET /openapi.json` (SPEC §13; issue 10 point 6).
//!
//! Every operation comes from its handler's `#[utoipa::path]` (typed request and response
//! bodies, parameters with their bounds, the statuses particular to the route); [`Common`] then
//! adds what every route shares, so no route can forget it:
//! - the security schemes (`bearer`: `Authorization: Bearer <key>`; `session`: the
//!   `agentloop_session` cookie) on every `/api` and `/v1` operation that does not say otherwise;
//! - the statuses the edge and the extractors can send: 400 and 431 everywhere; 408, 413 and
//!   415 and 503 (`server_busy`) with a request body; 401, 403 and 429 when authenticated; 404
//!   with path parameters; 503 wherever the database is read — all with the error envelope;
//! - `links` between create and read operations, for stateful contract tests.
//!
//! `tests/tests/contract.rs` checks that the document and the route table
//! ([`crate::routes::routes`]) list exactly the same operations, and runs schemathesis against
//! a live api.

use actix_web::{HttpResponse, web};
use utoipa::openapi::link::LinkBuilder;
use utoipa::openapi::path::Operation;
use utoipa::openapi::security::{ApiKey, ApiKeyValue, HttpAuthScheme, HttpBuilder, SecurityRequirement, SecurityScheme};
use utoipa::openapi::{Components, Content, Ref, RefOr, Response, ResponseBuilder};
use utoipa::{Modify, OpenApi};

use crate::routes;
use crate::openapi_protocols::Protocols;

/// The document (OpenAPI 3.1).
#[derive(OpenApi)]
#[openapi(
    info(title = "agentloop", description = "agentloop HTTP API: threads, chat commands, reads, SSE and long-poll"),
    paths(
        routes::health::healthz,
        routes::health::readyz,
        routes::health::metrics,
        routes::ui::index,
        routes::ui::asset,
        routes::search::search_threads::search_threads,
        routes::messages::list_branches::list_branches,
        routes::messages::activate_branch::activate_branch,
        routes::threads::restore_thread::restore_thread,
        routes::threads::export_thread::export_thread,
        openapi_json,
        routes::session::create_session::create_session,
        routes::session::get_session::get_session,
        routes::session::delete_session::delete_session,
        routes::models::list_models::list_models,
        routes::threads::create_thread::create_thread,
        routes::threads::list_threads::list_threads,
        routes::threads::get_thread::get_thread,
        routes::threads::update_thread::update_thread,
        routes::threads::delete_thread::delete_thread,
        routes::threads::list_messages::list_messages,
        routes::chat::post_chat::post_chat,
        routes::threads::cancel_thread::cancel_thread,
        routes::threads::compact_thread::compact_thread,
        routes::threads::get_context::get_context,
        routes::messages::edit_message::edit_message,
        routes::messages::regenerate_message::regenerate_message,
        routes::messages::delete_message::delete_message,
        routes::updates::stream_updates::stream_updates,
        routes::updates::poll_updates::poll_updates,
        routes::runs::get_run::get_run,
        routes::runs::cancel_run::cancel_run,
        routes::oauth::oauth_callback::oauth_callback,
        routes::approvals::list_approvals::list_approvals,
        routes::approvals::approve_approval::approve_approval,
        routes::approvals::reject_approval::reject_approval,
        routes::operations::list_operations::list_operations,
        routes::operations::resolve_operation::resolve_operation,
        routes::webhooks::create_webhook::create_webhook,
        routes::webhooks::list_webhooks::list_webhooks,
        routes::webhooks::get_webhook::get_webhook,
        routes::webhooks::delete_webhook::delete_webhook,
        routes::webhooks::list_deliveries::list_deliveries,
    ),
    components(schemas(crate::views::ErrorBody)),
    modifiers(&Protocols, &Common)
)]
pub struct ApiDoc;

/// `GET /openapi.json` (no auth). The long-poll wait bound is the server's configured
/// `LONG_POLL_MAX_MS`.
#[utoipa::path(get, path = "/openapi.json", tag = "meta", operation_id = "openapi", security(()),
    responses((status = 200, description = "This OpenAPI document", content_type = "application/json", body = Object)))]
///
/// Built once per process and served from memory: it has no auth, and building the ~140 KB
/// document on every call let a few unauthenticated clients take the api's CPU from every
/// tenant (acceptance probe H: others' reads from 11 ms to 2-13 s).
pub async fn openapi_json(state: web::Data<crate::AppState>) -> HttpResponse {
    static DOCUMENT: std::sync::OnceLock<(u64, actix_web::web::Bytes)> = std::sync::OnceLock::new();
    let max = state.long_poll_max.as_millis() as u64;
    let (built_for, body) = DOCUMENT.get_or_init(|| (max, document(max)));
    // Another configuration in the same process (tests): built for it, not cached.
    let body = if *built_for == max { body.clone() } else { document(max) };
    HttpResponse::Ok().content_type("application/json").body(body)
}

/// The document with the long-poll bound `max` ms, serialised.
fn document(max: u64) -> actix_web::web::Bytes {
    let mut doc = serde_json::to_value(ApiDoc::openapi()).unwrap_or_default();
    if let Some(params) = doc.pointer_mut("/paths/~1api~1threads~1{id}~1updates/get/parameters").and_then(|p| p.as_array_mut()) {
        for param in params.iter_mut().filter(|p| p["name"] == "timeoutMs") {
            param["schema"]["maximum"] = max.into();
        }
    }
    actix_web::web::Bytes::from(serde_json::to_vec(&doc).unwrap_or_default())
}

const BEARER: &str = "bearer";
const SESSION: &str = "session";

/// An error response with `envelope` (`Error`; `OpenAiError` on `/v1/*`) as its body.
fn error(description: &str, envelope: &str) -> Response {
    ResponseBuilder::new()
        .description(description)
        .content("application/json", Content::new(Some(Ref::from_schema_name(envelope))))
        .build()
}

fn add_default(op: &mut Operation, envelope: &str, status: &str, description: &str) {
    op.responses.responses.entry(status.to_owned()).or_insert_with(|| RefOr::T(error(description, envelope)));
}

/// Adds what every operation shares (see the module docs).
struct Common;

impl Modify for Common {
    fn modify(&self, openapi: &mut utoipa::openapi::OpenApi) {
        let components = openapi.components.get_or_insert_with(Components::default);
        components.add_security_scheme(
            BEARER,
            SecurityScheme::Http(HttpBuilder::new().scheme(HttpAuthScheme::Bearer).description(Some("API key: `Authorization: Bearer <key>`")).build()),
        );
        components.add_security_scheme(
            SESSION,
            SecurityScheme::ApiKey(ApiKey::Cookie(ApiKeyValue::with_description(
                crate::extract::SESSION_COOKIE,
                "Browser session from `POST /api/session`; requests other than GET/HEAD must also send `X-Requested-With: agentloop`",
            ))),
        );
        for (path, item) in openapi.paths.paths.iter_mut() {
            let api = path.starts_with("/api/") || path.starts_with("/v1/");
            let database = api || path == "/readyz";
            let has_path_params = path.contains('{');
            let envelope = if path.starts_with("/v1/") { "OpenAiError" } else { "Error" };
            for op in [&mut item.get, &mut item.post, &mut item.put, &mut item.patch, &mut item.delete].into_iter().flatten() {
                if api && op.security.is_none() {
                    op.security = Some(vec![SecurityRequirement::new(BEARER, Vec::<String>::new()), SecurityRequirement::new(SESSION, Vec::<String>::new())]);
                }
                let authenticated = op.security.as_ref().is_some_and(|s| {
                    s.iter().any(|r| serde_json::to_value(r).is_ok_and(|v| v.as_object().is_some_and(|o| !o.is_empty())))
                });
                add_default(op, envelope, "400", "Invalid request (query, headers or body)");
                add_default(op, envelope, "431", "Request headers too large");
                if op.request_body.is_some() {
                    add_default(op, envelope, "408", "`body_timeout`: the body did not arrive in time");
                    add_default(op, envelope, "413", "`payload_too_large`");
                    add_default(op, envelope, "415", "`unsupported_media_type`: bodies are JSON");
                    let busy = "`server_busy`: the body budget (`MAX_BODY_BYTES_IN_FLIGHT`) stayed used up (`Retry-After`)";
                    let busy = if database { format!("{busy}; `database_unavailable`, `statement_timeout`, `outcome_unknown`") } else { busy.to_owned() };
                    add_default(op, envelope, "503", &busy);
                }
                if authenticated {
                    add_default(op, envelope, "401", "A valid API key or session is required");
                    add_default(op, envelope, "403", "`csrf_header_missing`: a cookie-authenticated request needs `X-Requested-With: agentloop`");
                    add_default(op, envelope, "429", "A rate or per-principal limit (`Retry-After`)");
                }
                if has_path_params {
                    add_default(op, envelope, "404", "Not found");
                }
                if database {
                    add_default(op, envelope, "503", "`database_unavailable`, `statement_timeout`, `outcome_unknown`");
                }
            }
        }
        add_links(openapi);
    }
}

/// Links from the operations that create a resource to those that read or change it.
fn add_links(openapi: &mut utoipa::openapi::OpenApi) {
    let link = |operation: &str, param: &str, expression: &str| {
        LinkBuilder::new().operation_id(operation).parameter(param, expression).build()
    };
    let mut add = |path: &str, status: &str, links: Vec<(&str, utoipa::openapi::link::Link)>| {
        let Some(item) = openapi.paths.paths.get_mut(path) else { return };
        let Some(op) = item.post.as_mut() else { return };
        if let Some(RefOr::T(response)) = op.responses.responses.get_mut(status) {
            for (name, l) in links {
                response.links.insert(name.to_owned(), RefOr::T(l));
            }
        }
    };
    let thread = "$response.body#/id";
    add(
        "/api/threads",
        "201",
        vec![
            ("GetThread", link("get_thread", "id", thread)),
            ("UpdateThread", link("update_thread", "id", thread)),
            ("ListMessages", link("list_messages", "id", thread)),
            ("PostChat", link("post_chat", "id", thread)),
            ("GetContext", link("get_context", "id", thread)),
            ("PollUpdates", link("poll_updates", "id", thread)),
            ("ListApprovals", link("list_approvals", "id", thread)),
            ("CancelThread", link("cancel_thread", "id", thread)),
            ("CompactThread", link("compact_thread", "id", thread)),
            ("DeleteThread", link("delete_thread", "id", thread)),
        ],
    );
    let run = "$response.body#/run/id";
    add(
        "/api/threads/{id}/chat",
        "202",
        vec![
            ("GetRun", link("get_run", "id", run)),
            ("ListOperations", link("list_operations", "id", run)),
            ("CancelRun", link("cancel_run", "id", run)),
        ],
    );
    add(
        "/api/threads/{id}/compact",
        "201",
        vec![("GetChildThread", link("get_thread", "id", "$response.body#/thread/id")), ("GetCompactionRun", link("get_run", "id", run))],
    );
    let webhook = "$response.body#/id";
    add(
        "/api/webhooks",
        "201",
        vec![
            ("GetWebhook", link("get_webhook", "id", webhook)),
            ("ListWebhookDeliveries", link("list_webhook_deliveries", "id", webhook)),
            ("DeleteWebhook", link("delete_webhook", "id", webhook)),
        ],
    );
}
