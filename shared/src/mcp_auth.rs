//! MCP sign-in blockers (issue 12 part 5; docs/architecture.md §15): OAuth for MCP tool servers
//! configured with `"auth": {"type": "oauth", "clientId": ...}`, per the MCP authorization
//! specification (OAuth 2.1 authorization code + PKCE S256, RFC 9728 protected resource
//! metadata, RFC 8414 authorization server metadata, RFC 8707 `resource`).
//!
//! The protocol, all durable steps in SQL (`migrations/2026-12-03-000014_mcp_authorization`):
//! 1. Before calling a tool of such a server the worker reads the run's principal's token
//!    ([`token_for_call`], `agentloop_mcp_token`; an expired token is deleted) and claims the
//!    run's completed authorization of this call, if there is one — exactly once. The call goes
//!    over that principal's own session ([`crate::tools::mcp`]).
//! 2. A 401 answer ([`crate::tools::ToolError::AuthorizationRequired`]): the worker discovers
//!    the authorization server ([`discover`]: the challenge's `resource_metadata`, else the
//!    well-known URI of the server), makes a sign-in ([`SignIn::new`]: a random `state`, a PKCE
//!    verifier, the authorize URL) and parks the run ([`park`], `agentloop_mcp_park`): the
//!    call's `dispatched` operation goes back to `prepared` (a 401 had no effect), a token the
//!    server refused is discarded (revocation), the `mcp_authorizations` row (bound to the run's
//!    principal and the server; the state only as its SHA-256, the verifier sealed) is written and
//!    journaled (`authorization` event), and the run ends the slice `waiting_authorization` with
//!    its lease released — one transaction.
//! 3. The user opens the URL, signs in, and the authorization server redirects to
//!    `GET /api/oauth/callback?code&state` of the api, which requires the same principal's
//!    session or key: [`take_state`] makes the state single-use (another principal's state is
//!    404 and stays usable by its owner), [`exchange`] redeems the code with the verifier at the
//!    token endpoint, and [`finish`] stores the token sealed for (principal, server) and
//!    requeues the SAME run — one transaction.
//! 4. The run's next slice retries the same call under the same operation key with the token.
//!
//! Secrets at rest use [`crate::secrets`] under `OAUTH_TOKENS_KEY` (required for sign-in: tokens
//! are never stored in clear): the token with `principal || server` as additional data, the
//! verifier with the authorization id.

use std::time::{Duration, Instant};

use base64::Engine;
use base64::engine::general_purpose::URL_SAFE_NO_PAD as B64URL;
use serde::Deserialize;
use serde_json::{Value, json};
use sha2::Digest;
use uuid::Uuid;

use crate::scheduler::Lease;
use crate::scheduler::step::{Commit, Committed, SliceEnd};
use crate::secrets::{self, SecretsKey};
use crate::store::{Replay, Store, StoreError};
use crate::tools::mcp::AuthChallenge;

/// Journal event kind of an authorization change; payload = the authorization's public view
/// (`{id, runId, threadId, server, toolCallId, status, url?, error?, createdAt, expiresAt,
/// completedAt?, claimedAt?}`).
pub const EVENT_KIND: &str = "authorization";

/// Largest metadata document or token answer read, in bytes.
pub const MAX_DOCUMENT_BYTES: usize = 64 * 1024;

/// Timeout of one discovery or token request.
pub const REQUEST_TIMEOUT: Duration = Duration::from_secs(10);

/// Options of the api (callback) and the workers (sign-in URLs).
#[derive(Debug, Clone, clap::Args)]
pub struct OAuthArgs {
    /// Base64 of a 32-byte key: MCP sign-in tokens and PKCE verifiers are stored encrypted with
    /// it (AES-256-GCM). Must be the same on the api and every worker. Unset: MCP servers with
    /// `auth: oauth` cannot ask for a sign-in (their calls fail with an error result).
    #[arg(long, env = "OAUTH_TOKENS_KEY", hide_env_values = true)]
    pub oauth_tokens_key: Option<String>,

    /// The public URL of the api's `GET /api/oauth/callback` (the OAuth `redirect_uri`
    /// registered with the authorization servers), e.g.
    /// `https://agents.example.com/api/oauth/callback`. Workers: required for sign-in.
    #[arg(long, env = "OAUTH_REDIRECT_URL")]
    pub oauth_redirect_url: Option<String>,

    /// How long a sign-in link can be used, in ms (default 10 minutes).
    #[arg(long, env = "OAUTH_SIGNIN_TTL_MS", default_value_t = 600_000)]
    pub oauth_signin_ttl_ms: u64,
}

impl OAuthArgs {
    /// The tokens key, if configured. Errors: not base64 of 32 bytes.
    pub fn tokens_key(&self) -> anyhow::Result<Option<SecretsKey>> {
        self.oauth_tokens_key
            .as_deref()
            .filter(|k| !k.trim().is_empty())
            .map(|k| SecretsKey::parse_named(k, "OAUTH_TOKENS_KEY"))
            .transpose()
    }
}

/// The additional data binding a stored token to its principal and server.
fn token_aad(principal: Uuid, server: &str) -> Vec<u8> {
    let mut aad = principal.as_bytes().to_vec();
    aad.extend_from_slice(server.as_bytes());
    aad
}

/// SHA-256 (hex) of `text`.
pub fn sha256_hex(text: &str) -> String {
    hex::encode(sha2::Sha256::digest(text.as_bytes()))
}

/// The `S256` PKCE challenge of `verifier`: base64url(SHA-256(verifier)), no padding.
pub fn pkce_challenge(verifier: &str) -> String {
    B64URL.encode(sha2::Sha256::digest(verifier.as_bytes()))
}

/// A parameter of a `WWW-Authenticate: Bearer k="v", k2=v2` challenge.
pub fn challenge_param(header: &str, name: &str) -> Option<String> {
    let rest = header.trim_start();
    let rest = rest.strip_prefix("Bearer").or_else(|| rest.strip_prefix("bearer")).unwrap_or(rest);
    let mut chars = rest.char_indices().peekable();
    let bytes = rest;
    loop {
        // Skip separators.
        while let Some(&(_, c)) = chars.peek() {
            if c == ',' || c.is_whitespace() {
                chars.next();
            } else {
                break;
            }
        }
        let start = chars.peek()?.0;
        let mut eq = None;
        while let Some(&(i, c)) = chars.peek() {
            if c == '=' {
                eq = Some(i);
                chars.next();
                break;
            }
            if c == ',' {
                break;
            }
            chars.next();
        }
        let key = bytes[start..eq?].trim();
        let value = if chars.peek().is_some_and(|&(_, c)| c == '"') {
            chars.next();
            let mut value = String::new();
            while let Some((_, c)) = chars.next() {
                match c {
                    '\\' => {
                        if let Some((_, next)) = chars.next() {
                            value.push(next);
                        }
                    }
                    '"' => break,
                    c => value.push(c),
                }
            }
            value
        } else {
            let mut value = String::new();
            while let Some(&(_, c)) = chars.peek() {
                if c == ',' || c.is_whitespace() {
                    break;
                }
                value.push(c);
                chars.next();
            }
            value
        };
        if key.eq_ignore_ascii_case(name) {
            return Some(value);
        }
    }
}

/// What discovery found: where the user signs in and where codes are redeemed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Discovered {
    pub authorization_endpoint: String,
    pub token_endpoint: String,
    /// The protected resource (RFC 8707 `resource` parameter).
    pub resource: String,
    /// Scopes to request (space-separated), if any.
    pub scope: Option<String>,
}

#[derive(Deserialize)]
struct ResourceMetadata {
    resource: Option<String>,
    #[serde(default)]
    authorization_servers: Vec<String>,
    #[serde(default)]
    scopes_supported: Vec<String>,
}

#[derive(Deserialize)]
struct ServerMetadata {
    issuer: Option<String>,
    authorization_endpoint: String,
    token_endpoint: String,
    #[serde(default)]
    code_challenge_methods_supported: Option<Vec<String>>,
}

/// The HTTP client of discovery and token requests.
pub type HttpClient = reqwest::Client;

/// The HTTP client of discovery and token requests: timeouts, no redirects, no proxy.
pub fn client() -> HttpClient {
    let _ = rustls::crypto::ring::default_provider().install_default();
    reqwest::Client::builder()
        .connect_timeout(REQUEST_TIMEOUT)
        .timeout(REQUEST_TIMEOUT)
        .redirect(reqwest::redirect::Policy::none())
        .no_proxy()
        .build()
        .expect("a reqwest client without TLS roots of its own")
}

async fn get_json(client: &reqwest::Client, url: &str) -> Result<Option<Value>, String> {
    let response = client.get(url).header("accept", "application/json").send().await.map_err(|e| format!("GET {url}: {e}"))?;
    if response.status().as_u16() == 404 {
        return Ok(None);
    }
    if !response.status().is_success() {
        return Err(format!("GET {url}: HTTP {}", response.status().as_u16()));
    }
    read_json(response).await.map(Some).map_err(|e| format!("GET {url}: {e}"))
}

async fn read_json(mut response: reqwest::Response) -> Result<Value, String> {
    let mut body = Vec::new();
    while let Some(chunk) = response.chunk().await.map_err(|e| e.to_string())? {
        body.extend_from_slice(&chunk);
        if body.len() > MAX_DOCUMENT_BYTES {
            return Err(format!("answer over {MAX_DOCUMENT_BYTES} bytes"));
        }
    }
    serde_json::from_slice(&body).map_err(|e| format!("not JSON: {e}"))
}

/// `https://host/.well-known/<name><path>` of `url` (RFC 8414 §3.1 / RFC 9728 §3.1: the
/// well-known segment goes between the host and the path).
fn well_known(url: &reqwest::Url, name: &str) -> String {
    let path = url.path().trim_end_matches('/');
    format!("{}/.well-known/{name}{path}", url.origin().ascii_serialization())
}

/// Finds the authorization server of MCP server `server_url` from its 401 `challenge`
/// (MCP authorization: RFC 9728 then RFC 8414); `scopes` are the configured ones.
/// Errors are texts for the model and the log (no secrets in them).
pub async fn discover(client: &reqwest::Client, challenge: &AuthChallenge, server_url: &str, scopes: &[String]) -> Result<Discovered, String> {
    let server = reqwest::Url::parse(server_url).map_err(|e| format!("invalid server URL: {e}"))?;
    let header = challenge.www_authenticate.as_deref().unwrap_or_default();
    let metadata_url = challenge_param(header, "resource_metadata");
    let candidates = match &metadata_url {
        Some(url) => vec![url.clone()],
        None => vec![well_known(&server, "oauth-protected-resource"), format!("{}/.well-known/oauth-protected-resource", server.origin().ascii_serialization())],
    };
    let mut prm = None;
    for url in &candidates {
        if let Some(value) = get_json(client, url).await? {
            prm = Some(serde_json::from_value::<ResourceMetadata>(value).map_err(|e| format!("protected resource metadata at {url}: {e}"))?);
            break;
        }
    }
    let prm = prm.ok_or_else(|| "the server publishes no protected resource metadata (RFC 9728)".to_owned())?;
    let issuer = prm.authorization_servers.first().cloned().ok_or_else(|| "the protected resource metadata names no authorization server".to_owned())?;
    let issuer_url = reqwest::Url::parse(&issuer).map_err(|e| format!("invalid authorization server {issuer}: {e}"))?;
    let mut found = None;
    for url in [well_known(&issuer_url, "oauth-authorization-server"), well_known(&issuer_url, "openid-configuration")] {
        if let Some(value) = get_json(client, &url).await? {
            found = Some(serde_json::from_value::<ServerMetadata>(value).map_err(|e| format!("authorization server metadata at {url}: {e}"))?);
            break;
        }
    }
    let metadata = found.ok_or_else(|| format!("the authorization server {issuer} publishes no metadata (RFC 8414)"))?;
    if metadata.issuer.as_deref().is_some_and(|i| i.trim_end_matches('/') != issuer.trim_end_matches('/')) {
        return Err(format!("the authorization server metadata of {issuer} names another issuer"));
    }
    // MCP: PKCE S256 is required; metadata without the field cannot promise it.
    if !metadata.code_challenge_methods_supported.as_ref().is_some_and(|m| m.iter().any(|m| m == "S256")) {
        return Err(format!("the authorization server {issuer} does not support PKCE S256"));
    }
    // The authorize URL becomes a link in the UI and the token endpoint receives the code and
    // verifier: both must be http(s) URLs (a `javascript:` or `data:` link from a hostile
    // server's metadata would run in the app's origin when clicked).
    for (what, endpoint) in [("authorization", &metadata.authorization_endpoint), ("token", &metadata.token_endpoint)] {
        let scheme = reqwest::Url::parse(endpoint).map(|u| u.scheme().to_owned()).unwrap_or_default();
        if !matches!(scheme.as_str(), "https" | "http") {
            return Err(format!("the {what} endpoint of {issuer} is not an http(s) URL"));
        }
    }
    let scope = challenge_param(header, "scope")
        .or_else(|| (!scopes.is_empty()).then(|| scopes.join(" ")))
        .or_else(|| (!prm.scopes_supported.is_empty()).then(|| prm.scopes_supported.join(" ")));
    Ok(Discovered {
        authorization_endpoint: metadata.authorization_endpoint,
        token_endpoint: metadata.token_endpoint,
        resource: prm.resource.unwrap_or_else(|| server_url.to_owned()),
        scope,
    })
}

/// One sign-in about to be offered: the authorization row's secrets and its URL.
pub struct SignIn {
    pub id: Uuid,
    /// The `state` parameter (32 random bytes, base64url); only its hash is stored.
    pub state: String,
    /// The PKCE code verifier (32 random bytes, base64url).
    pub verifier: String,
    /// The authorize URL the user opens.
    pub url: String,
}

impl SignIn {
    /// A sign-in at `discovered`'s authorization endpoint for `client_id`, redirecting to
    /// `redirect_uri`. Errors: the endpoint is not a URL.
    pub fn new(discovered: &Discovered, client_id: &str, redirect_uri: &str) -> Result<Self, String> {
        let state = B64URL.encode(secrets::random_bytes::<32>());
        let verifier = B64URL.encode(secrets::random_bytes::<32>());
        let mut url = reqwest::Url::parse(&discovered.authorization_endpoint).map_err(|e| format!("invalid authorization endpoint: {e}"))?;
        {
            let mut query = url.query_pairs_mut();
            query
                .append_pair("response_type", "code")
                .append_pair("client_id", client_id)
                .append_pair("redirect_uri", redirect_uri)
                .append_pair("code_challenge", &pkce_challenge(&verifier))
                .append_pair("code_challenge_method", "S256")
                .append_pair("state", &state)
                .append_pair("resource", &discovered.resource);
            if let Some(scope) = &discovered.scope {
                query.append_pair("scope", scope);
            }
        }
        Ok(Self { id: Uuid::now_v7(), state, verifier, url: url.to_string() })
    }
}

/// Everything [`park`] writes besides the commit.
pub struct Park<'a> {
    pub sign_in: &'a SignIn,
    pub discovered: &'a Discovered,
    pub server: &'a str,
    pub client_id: &'a str,
    pub redirect_uri: &'a str,
    pub tool_call_id: &'a str,
    pub operation_key: &'a str,
    /// How long the link can be used.
    pub ttl: Duration,
    /// Fingerprint of a token the server just refused (discarded in the same transaction).
    pub discard: Option<String>,
}

/// Parks the leased run in `waiting_authorization` with `commit` (its end must be
/// [`SliceEnd::WaitingAuthorization`]) — `agentloop_mcp_park`, see the module docs. `None`:
/// the lease is gone. Retries transient faults and unknown outcomes until `deadline` (the commit
/// id makes it replay-safe).
pub async fn park(
    store: &Store,
    lease: &Lease,
    step_id: Option<i64>,
    commit: &Commit,
    park: &Park<'_>,
    key: &SecretsKey,
    deadline: Instant,
) -> Result<Option<Committed>, StoreError> {
    debug_assert_eq!(commit.end, Some(SliceEnd::WaitingAuthorization));
    let mut arg = serde_json::to_value(commit).map_err(|e| StoreError::Deterministic { sqlstate: "XX000".into(), message: e.to_string() })?;
    if let (Some(obj), Value::Object(fence)) = (arg.as_object_mut(), lease.fence_json()) {
        obj.extend(fence);
        obj.insert("commitId".into(), json!(Uuid::new_v4()));
        obj.insert("stepId".into(), json!(step_id));
        obj.insert(
            "authorization".into(),
            json!({
                "id": park.sign_in.id, "toolCallId": park.tool_call_id, "operationKey": park.operation_key,
                "server": park.server, "stateHash": sha256_hex(&park.sign_in.state), "authorizationUrl": park.sign_in.url,
                "codeVerifier": secrets::seal(&park.sign_in.verifier, Some(key), park.sign_in.id.as_bytes()),
                "tokenEndpoint": park.discovered.token_endpoint, "clientId": park.client_id, "redirectUri": park.redirect_uri,
                "resource": park.discovered.resource, "expiresInMs": park.ttl.as_millis() as u64,
                "discardFingerprint": park.discard,
            }),
        );
    }
    let value = store.call("agentloop_mcp_park", &arg, Replay::Safe, Some(deadline)).await?;
    if value.get("lost").and_then(Value::as_bool) == Some(true) {
        return Ok(None);
    }
    serde_json::from_value(value).map(Some).map_err(|e| StoreError::Deterministic { sqlstate: "XX000".into(), message: format!("decoding a step result: {e}") })
}

/// A principal's token for a call, from [`token_for_call`].
#[derive(Debug, Clone)]
pub struct CallToken {
    /// The run's principal.
    pub principal: Uuid,
    /// Their access token for the server, if they have a live one.
    pub token: Option<String>,
    /// The run's completed authorization for this call, claimed now (once).
    pub claimed: Option<Uuid>,
}

/// Reads the run's principal's token for MCP server `server` and claims the run's completed
/// authorization of call `tool_call_id` (`agentloop_mcp_token`; see the module docs). A token
/// that cannot be opened (key changed, row tampered with) counts as none.
pub async fn token_for_call(store: &Store, run_id: Uuid, server: &str, tool_call_id: &str, key: Option<&SecretsKey>) -> Result<Option<CallToken>, StoreError> {
    let value = store
        .call("agentloop_mcp_token", &json!({"runId": run_id, "server": server, "toolCallId": tool_call_id}), Replay::Safe, None)
        .await?;
    let Some(principal) = value.get("principalId").and_then(Value::as_str).and_then(|p| Uuid::parse_str(p).ok()) else {
        return Ok(None);
    };
    let token = value["token"]["accessToken"].as_str().and_then(|sealed| match secrets::open(sealed, key, &token_aad(principal, server)) {
        Ok(token) => Some(token),
        Err(error) => {
            tracing::warn!(mcp.server = server, ?error, "a stored MCP token cannot be opened; it is ignored");
            None
        }
    });
    let claimed = value.get("claimed").and_then(Value::as_str).and_then(|c| Uuid::parse_str(c).ok());
    Ok(Some(CallToken { principal, token, claimed }))
}

/// What the callback needs of a taken authorization ([`take_state`]).
#[derive(Debug, Clone, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Taken {
    pub id: Uuid,
    pub run_id: Uuid,
    pub server: String,
    pub principal_id: Uuid,
    /// Sealed.
    pub code_verifier: String,
    pub token_endpoint: String,
    pub client_id: String,
    pub redirect_uri: String,
    pub resource: Option<String>,
}

/// Takes the pending authorization whose state is `state`, for `principal` only, once
/// (`agentloop_mcp_take_state`): refusals 404 `authorization_not_found`, 409
/// `authorization_used`, 410 `authorization_expired`.
pub async fn take_state(store: &Store, principal: Uuid, state: &str) -> Result<Taken, StoreError> {
    let value = store
        .call("agentloop_mcp_take_state", &json!({"stateHash": sha256_hex(state), "principalId": principal}), Replay::Unsafe, None)
        .await?;
    serde_json::from_value(value).map_err(|e| StoreError::Deterministic { sqlstate: "XX000".into(), message: format!("decoding a step result: {e}") })
}

/// A token endpoint's answer.
#[derive(Debug, Clone)]
pub struct TokenAnswer {
    pub access_token: String,
    pub token_type: Option<String>,
    pub scope: Option<String>,
    /// Lifetime, if the server said.
    pub expires_in: Option<Duration>,
}

/// Redeems `code` at the taken authorization's token endpoint (authorization_code grant with the
/// PKCE verifier, RFC 8707 `resource`). Errors are texts without secrets.
pub async fn exchange(client: &reqwest::Client, taken: &Taken, code: &str, key: &SecretsKey) -> Result<TokenAnswer, String> {
    let verifier = secrets::open(&taken.code_verifier, Some(key), taken.id.as_bytes()).map_err(|e| format!("the sign-in's verifier cannot be opened ({e:?})"))?;
    // A form body, encoded by the URL serializer (reqwest's `form` feature is not enabled).
    let mut form = reqwest::Url::parse("http://form.invalid/").expect("a static URL");
    {
        let mut pairs = form.query_pairs_mut();
        pairs
            .append_pair("grant_type", "authorization_code")
            .append_pair("code", code)
            .append_pair("redirect_uri", &taken.redirect_uri)
            .append_pair("client_id", &taken.client_id)
            .append_pair("code_verifier", &verifier);
        if let Some(resource) = &taken.resource {
            pairs.append_pair("resource", resource);
        }
    }
    let body = form.query().unwrap_or_default().to_owned();
    let response = client
        .post(&taken.token_endpoint)
        .header("content-type", "application/x-www-form-urlencoded")
        .header("accept", "application/json")
        .body(body)
        .send()
        .await
        .map_err(|e| format!("the token endpoint cannot be reached: {e}"))?;
    let status = response.status().as_u16();
    let value = read_json(response).await.map_err(|e| format!("the token endpoint answered HTTP {status}: {e}"))?;
    if !(200..300).contains(&status) {
        let error = value["error"].as_str().unwrap_or("unknown error");
        return Err(format!("the token endpoint refused the code: HTTP {status} {error}"));
    }
    let access_token = value["access_token"].as_str().filter(|t| !t.is_empty()).ok_or("the token endpoint answered without an access_token")?;
    Ok(TokenAnswer {
        access_token: access_token.to_owned(),
        token_type: value["token_type"].as_str().map(str::to_owned),
        scope: value["scope"].as_str().map(str::to_owned),
        // A third party's number: anything not finite or absurd (> 10 years) is treated as 10
        // years rather than trusted into a Duration or a timestamp (which would panic or fail).
        expires_in: value["expires_in"].as_f64().filter(|s| *s >= 0.0).map(|s| Duration::from_secs_f64(s.min(MAX_TOKEN_LIFETIME_S))),
    })
}

/// Longest token lifetime taken from a token endpoint's `expires_in` (10 years, in seconds).
const MAX_TOKEN_LIFETIME_S: f64 = 10.0 * 365.0 * 86_400.0;

/// Ends a taken authorization (`agentloop_mcp_finish`): with `Ok(token)` the token is stored
/// sealed for (principal, server) and the authorization `completed`; with `Err(error)` it is
/// `failed`. The run, if it still waits, is requeued. Returns `{authorization, run}`.
pub async fn finish(store: &Store, taken: &Taken, outcome: Result<&TokenAnswer, &str>, key: &SecretsKey) -> Result<Value, StoreError> {
    let mut arg = json!({"authorizationId": taken.id, "principalId": taken.principal_id});
    match outcome {
        Ok(token) => {
            arg["token"] = json!({
                "accessToken": secrets::seal(&token.access_token, Some(key), &token_aad(taken.principal_id, &taken.server)),
                "fingerprint": crate::tools::mcp::fingerprint(&token.access_token),
                "tokenType": token.token_type, "scope": token.scope,
                "expiresInMs": token.expires_in.map(|d| d.as_millis() as u64),
            });
        }
        Err(error) => arg["error"] = json!(error),
    }
    store.call("agentloop_mcp_finish", &arg, Replay::Unsafe, None).await
}

/// The public views of the authorizations of `run_id`, oldest first (`GET /api/runs/{id}`).
pub async fn for_run(conn: &mut diesel_async::AsyncPgConnection, run_id: Uuid) -> diesel::QueryResult<Vec<Value>> {
    use diesel_async::RunQueryDsl;

    #[derive(diesel::QueryableByName)]
    struct Row {
        #[diesel(sql_type = diesel::sql_types::Jsonb)]
        view: Value,
    }
    let rows: Vec<Row> = diesel::sql_query(
        "SELECT agentloop_authorization_json(a) AS view FROM mcp_authorizations a WHERE a.run_id = $1 ORDER BY a.created_at, a.id",
    )
    .bind::<diesel::sql_types::Uuid, _>(run_id)
    .load(conn)
    .await?;
    Ok(rows.into_iter().map(|r| r.view).collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn challenge_parameters_are_parsed() {
        let header = r#"Bearer error="invalid_token", resource_metadata="http://127.0.0.1:9/.well-known/oauth-protected-resource", scope=tools"#;
        assert_eq!(challenge_param(header, "resource_metadata").as_deref(), Some("http://127.0.0.1:9/.well-known/oauth-protected-resource"));
        assert_eq!(challenge_param(header, "scope").as_deref(), Some("tools"));
        assert_eq!(challenge_param(header, "error").as_deref(), Some("invalid_token"));
        assert_eq!(challenge_param(header, "realm"), None);
        assert_eq!(challenge_param("Bearer", "scope"), None);
    }

    #[test]
    fn pkce_s256_matches_rfc_7636() {
        // RFC 7636 appendix B.
        assert_eq!(pkce_challenge("dBjftJeZ4CVP-mB92K27uhbUJU1p1r_wW1gFWFOEjXk"), "E9Melhoa2OwvFrEMTJguCHaoeK1t8URWbuGJSstw-cM");
    }

    #[test]
    fn well_known_uris_insert_the_segment_before_the_path() {
        let url = reqwest::Url::parse("http://h:1/tenant/mcp").unwrap();
        assert_eq!(well_known(&url, "oauth-protected-resource"), "http://h:1/.well-known/oauth-protected-resource/tenant/mcp");
        let url = reqwest::Url::parse("http://h:1/").unwrap();
        assert_eq!(well_known(&url, "oauth-authorization-server"), "http://h:1/.well-known/oauth-authorization-server");
    }
}
