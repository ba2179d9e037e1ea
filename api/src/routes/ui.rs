//! The web UI: `index.html` and its bundle (`ui/` built offline by esbuild into `api/static/ui/`,
//! committed), embedded in the binary — no CDN, it works with no internet. The page loads only
//! scripts and styles from `/assets/` (no inline script, style or event handler), so a strict
//! `Content-Security-Policy` (`script-src 'self'; style-src 'self'`) holds.

use actix_web::http::header;
use actix_web::{HttpResponse, web};

const INDEX_HTML: &str = include_str!("../../static/index.html");

/// The bundle's files: name, content type, bytes.
const ASSETS: &[(&str, &str, &[u8])] = &[
    ("app.js", "text/javascript; charset=utf-8", include_bytes!("../../static/ui/app.js")),
    ("app.css", "text/css; charset=utf-8", include_bytes!("../../static/ui/app.css")),
];

/// `GET /`: the web UI.
#[utoipa::path(get, path = "/", tag = "ui", operation_id = "ui_index", security(()),
    responses((status = 200, description = "The web UI page", content_type = "text/html", body = String)))]
pub async fn index() -> HttpResponse {
    HttpResponse::Ok()
        .content_type("text/html; charset=utf-8")
        .insert_header((header::CACHE_CONTROL, "no-cache"))
        .body(INDEX_HTML)
}

/// `GET /assets/{name}`: a file of the UI bundle (revalidated with an `ETag` of the build).
#[utoipa::path(get, path = "/assets/{name}", tag = "ui", operation_id = "ui_asset", security(()),
    params(("name" = String, Path, description = "File name of the bundle")),
    responses((status = 200, description = "The file", content((String = "text/javascript"), (String = "text/css"))),
              (status = 304, description = "Not modified (ETag)"),
              (status = 404, description = "No such file", body = crate::views::ErrorBody)))]
pub async fn asset(req: actix_web::HttpRequest, name: web::Path<String>) -> HttpResponse {
    let Some((_, kind, bytes)) = ASSETS.iter().find(|(n, _, _)| *n == name.as_str()) else {
        return HttpResponse::NotFound().json(serde_json::json!({"error": {"code": "not_found", "message": "not found"}}));
    };
    let etag = format!("\"{:x}-{}\"", fnv(bytes), bytes.len());
    if req.headers().get(header::IF_NONE_MATCH).and_then(|v| v.to_str().ok()) == Some(etag.as_str()) {
        return HttpResponse::NotModified().insert_header((header::ETAG, etag)).finish();
    }
    HttpResponse::Ok()
        .content_type(*kind)
        .insert_header((header::CACHE_CONTROL, "no-cache"))
        .insert_header((header::ETAG, etag))
        .body(*bytes)
}

/// FNV-1a of the bytes (an ETag, not a security property).
fn fnv(bytes: &[u8]) -> u64 {
    bytes.iter().fold(0xcbf2_9ce4_8422_2325u64, |h, b| (h ^ u64::from(*b)).wrapping_mul(0x0100_0000_01b3))
}
