//! The web UI: one self-contained page (no CDN, no build step), embedded in the binary.

use actix_web::HttpResponse;

const INDEX_HTML: &str = include_str!("../../static/index.html");

/// `GET /`: the web UI.
pub async fn index() -> HttpResponse {
    HttpResponse::Ok().content_type("text/html; charset=utf-8").body(INDEX_HTML)
}
