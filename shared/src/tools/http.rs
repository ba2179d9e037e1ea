//! HTTP tools from the tools file (`httpTools`): `POST <url>` with the validated argument
//! object as JSON and the call's stable key as `Idempotency-Key` (SPEC §7), so a receiver that
//! honours the header deduplicates a call that is retried after an explicit `retry` resolve.
//! Not idempotent unless configured: their calls go through the operations ledger.
//!
//! Each tool has its own client (reqwest): connect, read (idle) and total timeouts, no
//! redirects unless `"redirects": "same-origin"` (see [`super::config`]), and an answer read
//! chunk by chunk up to `maxResponseBytes`, never buffered whole.
//!
//! Outcomes (classified here, in [`classify_send_error`] and [`HttpTool`]'s answer rules):
//!
//! | what happened | outcome |
//! |---|---|
//! | 2xx | `Ok(body)` (cut at `maxResponseBytes` with a marker) |
//! | connection refused, DNS or TLS failure, connect timeout, invalid request | `Failed` (nothing was sent) |
//! | 3xx not followed (except 303), 4xx | `Failed` (the receiver refused) |
//! | timeout after connecting, reset or error while sending or reading, truncated body | `Uncertain` |
//! | 5xx, 303, other statuses | `Uncertain` (the receiver may have acted) |

use std::error::Error as StdError;
use std::time::Duration;

use futures_util::future::BoxFuture;
use reqwest::StatusCode;
use serde_json::{Value, json};

use super::config::{
    DEFAULT_HTTP_CONNECT_TIMEOUT_MS, DEFAULT_HTTP_READ_TIMEOUT_MS, DEFAULT_HTTP_TIMEOUT_MS, DEFAULT_MAX_RESPONSE_BYTES,
    HttpToolConfig, MAX_REDIRECT_HOPS, Redirects,
};
use super::{Tool, ToolContext, ToolError};

/// Longest `Location` value quoted in an outcome, in bytes.
const MAX_LOCATION_BYTES: usize = 512;

/// One configured HTTP tool.
#[derive(Debug, Clone)]
pub struct HttpTool {
    config: HttpToolConfig,
    /// The tool's client, or why it could not be built (every call then fails with it).
    client: Result<reqwest::Client, String>,
}

impl HttpTool {
    /// A tool for `config`, with its own client built from the config's timeouts and redirect
    /// policy. A client that cannot be built makes every call fail (nothing is sent).
    pub fn new(config: HttpToolConfig) -> Self {
        let ms = |value: Option<u64>, default: u64| Duration::from_millis(value.unwrap_or(default));
        let client = outbound_client(
            ms(config.connect_timeout_ms, DEFAULT_HTTP_CONNECT_TIMEOUT_MS),
            ms(config.read_timeout_ms, DEFAULT_HTTP_READ_TIMEOUT_MS),
            Some(ms(config.timeout_ms, DEFAULT_HTTP_TIMEOUT_MS)),
            redirect_policy(config.redirects, OnRefusedRedirect::Stop),
        )
        .build()
        .map_err(|e| describe(&e));
        Self { config, client }
    }
}

/// An outbound HTTP client builder: `connect` bounds TCP + TLS connect, `read` the wait for
/// the answer's headers and between two body reads, `total` (if any) the whole exchange;
/// `redirects` is the redirect policy ([`redirect_policy`]).
pub(crate) fn outbound_client(
    connect: Duration,
    read: Duration,
    total: Option<Duration>,
    redirects: reqwest::redirect::Policy,
) -> reqwest::ClientBuilder {
    // reqwest (here and in rmcp's HTTP transport) is built without a default TLS provider;
    // installing ring twice is harmless.
    let _ = rustls::crypto::ring::default_provider().install_default();
    let builder = reqwest::Client::builder().connect_timeout(connect).read_timeout(read).redirect(redirects);
    match total {
        Some(total) => builder.timeout(total),
        None => builder,
    }
}

/// What a redirect policy does with a redirect it does not follow.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum OnRefusedRedirect {
    /// Hand the 3xx answer to the caller (HTTP tools read its status and `Location`).
    Stop,
    /// Fail the request with a [`RedirectRefused`] error (for clients that hide the answer,
    /// like rmcp's transport).
    Error,
}

/// A redirect the policy refused to follow, as the source of a reqwest redirect error.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct RedirectRefused {
    /// The 3xx status.
    pub status: u16,
    /// Where it pointed (bounded).
    pub location: String,
    /// Why it was not followed.
    pub reason: &'static str,
}

impl std::fmt::Display for RedirectRefused {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "HTTP {} redirect to {} not followed ({})", self.status, self.location, self.reason)
    }
}

impl StdError for RedirectRefused {}

/// Why a redirect is not followed under `redirects`, or `None` to follow it.
fn refuse_reason(redirects: Redirects, status: StatusCode, first: Option<&reqwest::Url>, next: &reqwest::Url, hops: usize) -> Option<&'static str> {
    match redirects {
        Redirects::None => Some("redirects are off for this tool"),
        Redirects::SameOrigin => {
            if !matches!(status, StatusCode::TEMPORARY_REDIRECT | StatusCode::PERMANENT_REDIRECT) {
                Some("only 307 and 308 redirects are followed")
            } else if first.is_none_or(|first| first.origin() != next.origin()) {
                Some("only same-origin redirects are followed")
            } else if hops > MAX_REDIRECT_HOPS {
                Some("too many redirects")
            } else {
                None
            }
        }
    }
}

/// The redirect policy of `redirects` (see [`Redirects`]).
pub(crate) fn redirect_policy(redirects: Redirects, refused: OnRefusedRedirect) -> reqwest::redirect::Policy {
    reqwest::redirect::Policy::custom(move |attempt| {
        let previous = attempt.previous();
        match refuse_reason(redirects, attempt.status(), previous.first(), attempt.url(), previous.len()) {
            None => attempt.follow(),
            Some(_) if refused == OnRefusedRedirect::Stop => attempt.stop(),
            Some(reason) => {
                let error = RedirectRefused { status: attempt.status().as_u16(), location: bounded(attempt.url().as_str()), reason };
                attempt.error(error)
            }
        }
    })
}

/// `text` cut to [`MAX_LOCATION_BYTES`].
fn bounded(text: &str) -> String {
    if text.len() <= MAX_LOCATION_BYTES {
        return text.to_owned();
    }
    format!("{}…", &text[..text.floor_char_boundary(MAX_LOCATION_BYTES)])
}

/// The error and its sources, joined by `: ` (each text once), without the URLs reqwest
/// appends (a configured URL may carry a secret in its query).
pub(crate) fn describe(error: &(dyn StdError + 'static)) -> String {
    let chain = || std::iter::successors(Some(error), |e: &&(dyn StdError + 'static)| (*e).source());
    let urls: Vec<String> = chain()
        .filter_map(|e| e.downcast_ref::<reqwest::Error>().and_then(reqwest::Error::url))
        .map(|url| format!(" for url ({url})"))
        .collect();
    let mut parts: Vec<String> = Vec::new();
    for e in chain() {
        let text = urls.iter().fold(e.to_string(), |text, url| text.replace(url, ""));
        if !parts.iter().any(|p| p.contains(&text)) {
            parts.push(text);
        }
    }
    parts.join(": ")
}

/// The refused redirect behind `error`, if a redirect policy refused one.
pub(crate) fn refused_redirect<'a>(error: &'a (dyn StdError + 'static)) -> Option<&'a RedirectRefused> {
    let mut current = Some(error);
    while let Some(e) = current {
        if let Some(refused) = e.downcast_ref::<RedirectRefused>() {
            return Some(refused);
        }
        current = e.source();
    }
    None
}

/// Classifies a reqwest error of an outbound request by whether its request may have reached
/// the receiver; `what` prefixes the text (e.g. the tool's name).
///
/// - [`ToolError::Failed`]: certainly nothing was sent — an invalid request (builder error) or
///   a failure to connect (`is_connect`: DNS, connection refused, TLS handshake, the connect
///   timeout) — or the receiver answered with a redirect that was not followed (except 303).
/// - [`ToolError::Uncertain`]: everything else — a read or total timeout (reqwest reports one
///   that fires while still connecting as a plain timeout, indistinguishable from one after the
///   request was written, so it counts as uncertain too), a reset or closed connection while
///   sending or reading, a body or decode error, a refused 303 ("see other": the request was
///   processed).
pub fn classify_send_error(error: &reqwest::Error, what: &str) -> ToolError {
    let text = format!("{what}: {}", describe(error));
    if let Some(refused) = refused_redirect(error) {
        return if refused.status == 303 { ToolError::Uncertain(text) } else { ToolError::Failed(text) };
    }
    if error.is_builder() || error.is_connect() { ToolError::Failed(text) } else { ToolError::Uncertain(text) }
}

/// Reads `response`'s body chunk by chunk, at most `cap` bytes; `true` if more was offered.
async fn read_capped(response: &mut reqwest::Response, cap: usize) -> reqwest::Result<(Vec<u8>, bool)> {
    let expected = response.content_length().map_or(0, |n| n as usize);
    let mut body = Vec::with_capacity(expected.min(cap).min(64 * 1024));
    while let Some(chunk) = response.chunk().await? {
        let room = cap - body.len();
        if chunk.len() > room {
            body.extend_from_slice(&chunk[..room]);
            return Ok((body, true));
        }
        body.extend_from_slice(&chunk);
    }
    Ok((body, false))
}

impl Tool for HttpTool {
    fn name(&self) -> &str {
        &self.config.name
    }

    fn description(&self) -> &str {
        &self.config.description
    }

    fn parameters(&self) -> Value {
        self.config.parameters.clone().unwrap_or_else(|| json!({"type": "object", "properties": {}}))
    }

    fn idempotent(&self) -> bool {
        false
    }

    /// `Ok(body)` for a 2xx answer (cut at `maxResponseBytes`, ending with
    /// `…[answer cut at N bytes: the receiver sent more]`); `Failed` when nothing was sent or
    /// the receiver refused (3xx other than 303, 4xx: `HTTP <status>: <body>`); `Uncertain` when
    /// the receiver may have acted (5xx, 303, timeouts and errors after connecting); see the
    /// module docs.
    fn call(&self, args: Value, ctx: ToolContext) -> BoxFuture<'static, Result<String, ToolError>> {
        let name = self.config.name.clone();
        let client = match &self.client {
            Ok(client) => client.clone(),
            Err(error) => {
                let error = ToolError::Failed(format!("{name}: cannot build the HTTP client: {error}"));
                return Box::pin(std::future::ready(Err(error)));
            }
        };
        let mut request = client.post(&self.config.url).header("Idempotency-Key", &ctx.idempotency_key).json(&args);
        for (header, value) in &self.config.headers {
            request = request.header(header, value);
        }
        let cap = self.config.max_response_bytes.unwrap_or(DEFAULT_MAX_RESPONSE_BYTES);
        let redirects = self.config.redirects;
        Box::pin(async move {
            let mut response = request.send().await.map_err(|e| classify_send_error(&e, &name))?;
            let status = response.status();
            if status.is_redirection() {
                let location = response.headers().get(reqwest::header::LOCATION).map(|v| bounded(&String::from_utf8_lossy(v.as_bytes())));
                let reason = match redirects {
                    Redirects::None => "redirects are off for this tool",
                    Redirects::SameOrigin => "only same-origin 307/308 redirects are followed",
                };
                let text = format!(
                    "{name}: HTTP {} redirect to {} not followed ({reason})",
                    status.as_u16(),
                    location.as_deref().unwrap_or("(no Location)")
                );
                return Err(if status == StatusCode::SEE_OTHER { ToolError::Uncertain(text) } else { ToolError::Failed(text) });
            }
            let (body, cut) = match read_capped(&mut response, cap).await {
                Ok(read) => read,
                Err(error) if status.is_client_error() => {
                    return Err(ToolError::Failed(format!("HTTP {}: (answer unreadable: {})", status.as_u16(), describe(&error))));
                }
                Err(error) => {
                    let text = format!("{name}: reading the answer (HTTP {}): {}", status.as_u16(), describe(&error));
                    return Err(ToolError::Uncertain(text));
                }
            };
            let mut text = String::from_utf8_lossy(&body).into_owned();
            drop(body);
            if cut {
                text.push_str(&format!("\n…[answer cut at {cap} bytes: the receiver sent more]"));
            }
            if status.is_success() {
                Ok(text)
            } else if status.is_client_error() {
                Err(ToolError::Failed(format!("HTTP {}: {text}", status.as_u16())))
            } else {
                Err(ToolError::Uncertain(format!("HTTP {}: {text}", status.as_u16())))
            }
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_same_origin_307_and_308_within_the_hop_limit_are_followed() {
        let url = |s: &str| reqwest::Url::parse(s).unwrap();
        let first = url("https://api.example/pay");
        let decide = |redirects, status, next: &str, hops| refuse_reason(redirects, status, Some(&first), &url(next), hops);
        assert_eq!(decide(Redirects::SameOrigin, StatusCode::TEMPORARY_REDIRECT, "https://api.example/v2/pay", 1), None);
        assert_eq!(decide(Redirects::SameOrigin, StatusCode::PERMANENT_REDIRECT, "https://api.example:443/x", 1), None, "the default port is the same origin");
        for other in ["http://api.example/pay", "https://api.example:8443/pay", "https://evil.example/pay", "https://x.api.example/pay"] {
            assert!(decide(Redirects::SameOrigin, StatusCode::TEMPORARY_REDIRECT, other, 1).is_some(), "{other} is another origin");
        }
        for status in [StatusCode::MOVED_PERMANENTLY, StatusCode::FOUND, StatusCode::SEE_OTHER] {
            assert!(decide(Redirects::SameOrigin, status, "https://api.example/x", 1).is_some(), "{status}");
        }
        assert!(decide(Redirects::SameOrigin, StatusCode::TEMPORARY_REDIRECT, "https://api.example/x", MAX_REDIRECT_HOPS + 1).is_some());
        assert!(decide(Redirects::None, StatusCode::TEMPORARY_REDIRECT, "https://api.example/x", 1).is_some());
    }

    #[test]
    fn long_locations_are_bounded() {
        let error = RedirectRefused { status: 307, location: "x".repeat(2000), reason: "r" };
        assert!(bounded(&error.location).len() <= MAX_LOCATION_BYTES + 3);
    }
}
