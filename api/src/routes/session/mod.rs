//! Browser sign-in sessions (CONTRACTS.md "Browser sign-in session"): exchange an API key for an
//! HttpOnly session cookie, read who is signed in, sign out.

pub mod create_session;
pub mod delete_session;
pub mod get_session;

/// `Set-Cookie` of the session cookie: `HttpOnly; SameSite=Strict; Path=/`, plus `Secure` when
/// the request came over https (directly or `X-Forwarded-Proto: https`); `max_age = Some(0)`
/// expires it at once.
pub fn cookie(req: &actix_web::HttpRequest, token: &str, max_age: Option<u32>) -> String {
    let secure = if req.connection_info().scheme().eq_ignore_ascii_case("https") { "; Secure" } else { "" };
    let max_age = max_age.map_or_else(String::new, |s| format!("; Max-Age={s}"));
    format!("{}={token}; HttpOnly; SameSite=Strict; Path=/{max_age}{secure}", crate::extract::SESSION_COOKIE)
}
