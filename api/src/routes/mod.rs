//! The route table (SPEC §13). One handler per file under `routes/<resource>/`.
//!
//! Routes are listed once, in [`table`], as (method, full path, handler). The table registers
//! one actix resource per path with all its methods, so a known path with another method is 405
//! with `Allow` (enveloped by the edge middleware); static paths are registered before paths with
//! parameters (`/api/threads/import` before `/api/threads/{id}`). The same table, recorded
//! without handlers ([`routes`]), is what the contract test compares with the OpenAPI document.

pub mod approvals;
pub mod chat;
pub mod health;
pub mod messages;
pub mod models;
pub mod oauth;
pub mod openai;
pub mod operations;
pub mod runs;
pub mod search;
pub mod session;
pub mod threads;
pub mod ui;
pub mod updates;
pub mod webhooks;

use actix_web::http::Method;
use actix_web::{Handler, Responder, Route, web};

/// Collects routes; see the module docs.
#[derive(Default)]
pub struct Table {
    routes: Vec<(Method, &'static str, Option<Route>)>,
    record_only: bool,
}

impl Table {
    /// Adds `method path` served by `handler`.
    pub fn add<F, Args>(&mut self, method: Method, path: &'static str, handler: F) -> &mut Self
    where
        F: Handler<Args>,
        Args: actix_web::FromRequest + 'static,
        F::Output: Responder + 'static,
    {
        let route = (!self.record_only).then(|| {
            if method == Method::GET && HEAD_TOO.contains(&path) {
                web::route().guard(actix_web::guard::Any(actix_web::guard::Get()).or(actix_web::guard::Head())).to(handler)
            } else {
                web::method(method.clone()).to(handler)
            }
        });
        self.routes.push((method, path, route));
        self
    }
}

/// GET routes that also answer HEAD (the same headers, no body: actix drops a HEAD answer's
/// body), for monitors and load balancers that probe with HEAD. Not the API's reads: a HEAD of a
/// long-poll would wait like the GET.
const HEAD_TOO: &[&str] = &["/healthz", "/readyz", "/", "/assets/{name}", "/openapi.json"];

/// Every route of the api.
pub fn table(t: &mut Table) {
    use Method as M;
    t.add(M::GET, "/healthz", health::healthz)
        .add(M::GET, "/readyz", health::readyz)
        .add(M::GET, "/metrics", health::metrics)
        .add(M::GET, "/", ui::index)
        .add(M::GET, "/assets/{name}", ui::asset)
        .add(M::GET, "/openapi.json", crate::openapi::openapi_json)
        .add(M::POST, "/v1/chat/completions", openai::chat_completions::chat_completions)
        .add(M::GET, "/v1/models", openai::list_models::list_models)
        .add(M::GET, "/v1/models/{id}", openai::list_models::get_model)
        .add(M::POST, "/mcp", crate::mcp::serve)
        .add(M::POST, "/api/threads/import", threads::import_thread::import_thread)
        .add(M::POST, "/api/session", session::create_session::create_session)
        .add(M::GET, "/api/session", session::get_session::get_session)
        .add(M::DELETE, "/api/session", session::delete_session::delete_session)
        .add(M::GET, "/api/models", models::list_models::list_models)
        .add(M::GET, "/api/search", search::search_threads::search_threads)
        .add(M::POST, "/api/threads", threads::create_thread::create_thread)
        .add(M::GET, "/api/threads", threads::list_threads::list_threads)
        .add(M::GET, "/api/threads/{id}", threads::get_thread::get_thread)
        .add(M::PATCH, "/api/threads/{id}", threads::update_thread::update_thread)
        .add(M::DELETE, "/api/threads/{id}", threads::delete_thread::delete_thread)
        .add(M::GET, "/api/threads/{id}/messages", threads::list_messages::list_messages)
        .add(M::POST, "/api/threads/{id}/chat", chat::post_chat::post_chat)
        .add(M::POST, "/api/threads/{id}/cancel", threads::cancel_thread::cancel_thread)
        .add(M::POST, "/api/threads/{id}/compact", threads::compact_thread::compact_thread)
        .add(M::GET, "/api/threads/{id}/context", threads::get_context::get_context)
        .add(M::POST, "/api/threads/{id}/messages/{sequence}/edit", messages::edit_message::edit_message)
        .add(M::POST, "/api/threads/{id}/messages/{sequence}/regenerate", messages::regenerate_message::regenerate_message)
        .add(M::DELETE, "/api/threads/{id}/messages/{sequence}", messages::delete_message::delete_message)
        .add(M::GET, "/api/threads/{id}/messages/{sequence}/branches", messages::list_branches::list_branches)
        .add(M::POST, "/api/threads/{id}/messages/{sequence}/branches/activate", messages::activate_branch::activate_branch)
        .add(M::POST, "/api/threads/{id}/restore", threads::restore_thread::restore_thread)
        .add(M::GET, "/api/threads/{id}/export", threads::export_thread::export_thread)
        .add(M::GET, "/api/threads/{id}/updates/stream", updates::stream_updates::stream_updates)
        .add(M::GET, "/api/threads/{id}/updates", updates::poll_updates::poll_updates)
        .add(M::GET, "/api/runs/{id}", runs::get_run::get_run)
        .add(M::POST, "/api/runs/{id}/cancel", runs::cancel_run::cancel_run)
        .add(M::GET, "/api/oauth/callback", oauth::oauth_callback::oauth_callback)
        .add(M::GET, "/api/threads/{id}/approvals", approvals::list_approvals::list_approvals)
        .add(M::POST, "/api/approvals/{id}/approve", approvals::approve_approval::approve_approval)
        .add(M::POST, "/api/approvals/{id}/reject", approvals::reject_approval::reject_approval)
        .add(M::GET, "/api/runs/{id}/operations", operations::list_operations::list_operations)
        .add(M::POST, "/api/runs/{id}/operations/{key}/resolve", operations::resolve_operation::resolve_operation)
        .add(M::POST, "/api/webhooks", webhooks::create_webhook::create_webhook)
        .add(M::GET, "/api/webhooks", webhooks::list_webhooks::list_webhooks)
        .add(M::GET, "/api/webhooks/{id}", webhooks::get_webhook::get_webhook)
        .add(M::DELETE, "/api/webhooks/{id}", webhooks::delete_webhook::delete_webhook)
        .add(M::GET, "/api/webhooks/{id}/deliveries", webhooks::list_deliveries::list_deliveries);
}

/// The route table as (method, path), without handlers.
pub fn routes() -> Vec<(Method, &'static str)> {
    let mut t = Table { routes: Vec::new(), record_only: true };
    table(&mut t);
    t.routes.into_iter().map(|(m, p, _)| (m, p)).collect()
}

/// Literal segments sort before parameters, segment by segment (more specific first).
fn specificity(path: &str) -> Vec<u8> {
    path.split('/').map(|s| u8::from(s.starts_with('{'))).collect()
}

/// Registers every route (grouped into one resource per path) and the fallback.
pub fn configure(cfg: &mut web::ServiceConfig) {
    let mut t = Table::default();
    table(&mut t);
    let mut paths: Vec<&'static str> = Vec::new();
    for (_, path, _) in &t.routes {
        if !paths.contains(path) {
            paths.push(path);
        }
    }
    paths.sort_by_key(|p| specificity(p));
    let mut routes = t.routes;
    for path in paths {
        let mut resource = web::resource(path);
        if path == "/mcp" {
            resource = resource.app_data(web::PayloadConfig::new(4 * 1024 * 1024));
        }
        for (_, _, route) in routes.iter_mut().filter(|(_, p, _)| *p == path) {
            resource = resource.route(route.take().expect("built routes"));
        }
        cfg.service(resource);
    }
    cfg.default_service(web::to(not_found));
}

/// No route has this path: 404 `route_not_found` (a route's own "no such resource" is
/// `not_found`).
async fn not_found() -> Result<actix_web::HttpResponse, crate::error::ApiError> {
    Err(crate::error::ApiError::Status {
        status: actix_web::http::StatusCode::NOT_FOUND,
        code: "route_not_found",
        message: "no such route".into(),
    })
}
