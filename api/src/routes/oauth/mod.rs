//! MCP sign-in (issue 12 part 5): the OAuth callback of MCP tool servers with `auth: oauth`.
//! The protocol: `agentloop_shared::mcp_auth`, docs/architecture.md §15.

pub mod oauth_callback;

/// Sign-in settings of the api.
pub struct OAuthState {
    /// `OAUTH_TOKENS_KEY`: tokens and verifiers are sealed with it; without it no sign-in can be
    /// pending and the callback answers 404 `not_found`.
    pub key: Option<agentloop_shared::secrets::SecretsKey>,
    /// Token requests (timeouts, no redirects, no proxy).
    pub client: agentloop_shared::mcp_auth::HttpClient,
}
