//! The route table (SPEC §13). One handler per file under `routes/<resource>/`.

pub mod approvals;
pub mod chat;
pub mod health;
pub mod messages;
pub mod models;
pub mod openai;
pub mod operations;
pub mod runs;
pub mod threads;
pub mod ui;
pub mod updates;

use actix_web::web;

/// Registers every route.
pub fn configure(cfg: &mut web::ServiceConfig) {
    cfg.route("/healthz", web::get().to(health::healthz))
        .route("/readyz", web::get().to(health::readyz))
        .route("/metrics", web::get().to(health::metrics))
        .route("/", web::get().to(ui::index))
        .route("/openapi.json", web::get().to(crate::openapi::openapi_json))
        .route("/v1/chat/completions", web::post().to(openai::chat_completions::chat_completions))
        .service(
            web::scope("/api")
                .route("/models", web::get().to(models::list_models::list_models))
                .route("/threads", web::post().to(threads::create_thread::create_thread))
                .route("/threads", web::get().to(threads::list_threads::list_threads))
                .route("/threads/{id}", web::get().to(threads::get_thread::get_thread))
                .route("/threads/{id}", web::patch().to(threads::update_thread::update_thread))
                .route("/threads/{id}", web::delete().to(threads::delete_thread::delete_thread))
                .route("/threads/{id}/messages", web::get().to(threads::list_messages::list_messages))
                .route("/threads/{id}/chat", web::post().to(chat::post_chat::post_chat))
                .route("/threads/{id}/cancel", web::post().to(threads::cancel_thread::cancel_thread))
                .route("/threads/{id}/compact", web::post().to(threads::compact_thread::compact_thread))
                .route("/threads/{id}/context", web::get().to(threads::get_context::get_context))
                .route("/threads/{id}/messages/{sequence}/edit", web::post().to(messages::edit_message::edit_message))
                .route(
                    "/threads/{id}/messages/{sequence}/regenerate",
                    web::post().to(messages::regenerate_message::regenerate_message),
                )
                .route("/threads/{id}/messages/{sequence}", web::delete().to(messages::delete_message::delete_message))
                .route("/threads/{id}/updates/stream", web::get().to(updates::stream_updates::stream_updates))
                .route("/threads/{id}/updates", web::get().to(updates::poll_updates::poll_updates))
                .route("/runs/{id}", web::get().to(runs::get_run::get_run))
                .route("/runs/{id}/cancel", web::post().to(runs::cancel_run::cancel_run))
                .route("/threads/{id}/approvals", web::get().to(approvals::list_approvals::list_approvals))
                .route("/approvals/{id}/approve", web::post().to(approvals::approve_approval::approve_approval))
                .route("/approvals/{id}/reject", web::post().to(approvals::reject_approval::reject_approval))
                .route("/runs/{id}/operations", web::get().to(operations::list_operations::list_operations))
                .route(
                    "/runs/{id}/operations/{key}/resolve",
                    web::post().to(operations::resolve_operation::resolve_operation),
                )
                .default_service(web::to(not_found)),
        )
        .default_service(web::to(not_found));
}

async fn not_found() -> Result<actix_web::HttpResponse, crate::error::ApiError> {
    Err(crate::error::ApiError::NotFound)
}
