//! Webhooks on run state (issue 12, part 2): event types, signing secrets, Standard Webhooks
//! signatures, target checks and the safe outbound client of the workers' deliveries.
//!
//! The outbox is in SQL (`migrations/2026-12-02-000011_webhooks`): an AFTER UPDATE OF status
//! trigger on `runs` writes one `webhook_deliveries` row per matching webhook in the
//! transaction of the transition. Workers claim due rows, send them with [`send`] and record
//! each attempt (`worker/src/webhooks.rs`).
//!
//! Signatures follow the Standard Webhooks specification
//! (<https://github.com/standard-webhooks/standard-webhooks/blob/main/spec/standard-webhooks.md>):
//! headers `webhook-id` (`msg_<delivery id>`, the same on every attempt of a delivery, for the
//! receiver's deduplication), `webhook-timestamp` (unix seconds of the attempt) and
//! `webhook-signature` = `v1,` + base64(HMAC-SHA256(secret bytes, `"{id}.{timestamp}.{body}"`)),
//! where the secret is shown once as `whsec_<base64 of 32 random bytes>` and its bytes are the
//! base64-decoded part after `whsec_`.
//!
//! Outbound requests follow the HTTP tools' safe-client rules ([`crate::tools`]): no redirect is
//! followed, connect and total timeouts, at most [`MAX_RESPONSE_BODY_BYTES`] of the answer are
//! read (while it streams in), no proxy from the environment, and — unless
//! `WEBHOOK_ALLOW_PRIVATE_TARGETS` — no target that is not a public address: IP literals are
//! checked before sending and host names by the client's resolver at every connection, so a
//! name that resolves (or re-binds) to a private address is refused ([`is_public`]).

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};
use std::sync::Arc;
use std::time::{Duration, Instant};

use base64::Engine;
use base64::engine::general_purpose::STANDARD as B64;
use ring::hmac;
use uuid::Uuid;

/// NOTIFY channel of new deliveries (the outbox trigger; empty payload).
pub const WEBHOOKS_CHANNEL: &str = "agentloop_webhooks";

/// Event types a webhook may subscribe to: `run.<status>` for these run states.
pub const EVENT_TYPES: [&str; 6] =
    ["run.completed", "run.failed", "run.cancelled", "run.waiting_approval", "run.waiting_authorization", "run.blocked"];

/// Longest webhook URL, in bytes.
pub const MAX_URL_BYTES: usize = 2048;

/// Bytes of a receiver's answer that are read and recorded per attempt.
pub const MAX_RESPONSE_BODY_BYTES: usize = 1024;

/// Prefix of a shown signing secret.
pub const SECRET_PREFIX: &str = "whsec_";

/// Options shared by the api (creation) and the workers (delivery).
#[derive(Debug, Clone, clap::Args)]
pub struct WebhookArgs {
    /// Base64 of a 32-byte key: signing secrets are stored encrypted with it (AES-256-GCM).
    /// Must be the same on the api and every worker. Unset: secrets are stored as they are.
    #[arg(long, env = "WEBHOOK_SECRETS_KEY", hide_env_values = true)]
    pub webhook_secrets_key: Option<String>,

    /// Allow webhook targets on loopback, private, link-local and other non-public addresses
    /// (refused by default: a webhook URL is chosen by an API caller).
    #[arg(long, env = "WEBHOOK_ALLOW_PRIVATE_TARGETS", default_value_t = false, action = clap::ArgAction::Set,
          value_parser = clap::builder::BoolishValueParser::new())]
    pub webhook_allow_private_targets: bool,
}

impl WebhookArgs {
    /// The configured secrets key, if any. Errors: not base64 of 32 bytes.
    pub fn secrets_key(&self) -> anyhow::Result<Option<SecretsKey>> {
        self.webhook_secrets_key.as_deref().filter(|k| !k.trim().is_empty()).map(SecretsKey::parse).transpose()
    }
}

pub use crate::secrets::SecretsKey;

/// Why a stored secret cannot be used.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SecretError {
    #[error("the signing secret is stored encrypted but WEBHOOK_SECRETS_KEY is not configured")]
    NoKey,
    #[error("the signing secret cannot be decrypted (WEBHOOK_SECRETS_KEY differs from the one it was stored with)")]
    WrongKey,
    #[error("the stored signing secret is malformed")]
    Malformed,
}

use crate::secrets::random_bytes;

/// A new signing secret: `whsec_` + base64 of 32 random bytes.
pub fn new_secret() -> String {
    format!("{SECRET_PREFIX}{}", B64.encode(random_bytes::<32>()))
}

/// The stored form of `secret` for webhook `id`: `v1:<base64(nonce || ciphertext || tag)>`
/// (AES-256-GCM, the webhook id as additional data, so a stored value cannot be moved to another
/// webhook) with a key, `plain:<secret>` without.
pub fn seal(secret: &str, key: Option<&SecretsKey>, id: Uuid) -> String {
    crate::secrets::seal(secret, key, id.as_bytes())
}

/// The secret of webhook `id` from its stored form (see [`seal`]).
pub fn open(stored: &str, key: Option<&SecretsKey>, id: Uuid) -> Result<String, SecretError> {
    crate::secrets::open(stored, key, id.as_bytes()).map_err(|e| match e {
        crate::secrets::OpenError::NoKey => SecretError::NoKey,
        crate::secrets::OpenError::WrongKey => SecretError::WrongKey,
        crate::secrets::OpenError::Malformed => SecretError::Malformed,
    })
}

/// The `webhook-id` of delivery `id`: `msg_` + its 32 hex digits (stable across attempts).
pub fn message_id(id: Uuid) -> String {
    format!("msg_{}", id.simple())
}

/// The `webhook-signature` value `v1,<base64 HMAC-SHA256>` of `body` sent as message `msg_id`
/// at `timestamp` (unix seconds) with `secret` (`whsec_<base64>`; its decoded bytes are the
/// key). `None` when the secret is not of that form.
pub fn sign(secret: &str, msg_id: &str, timestamp: i64, body: &[u8]) -> Option<String> {
    let key = B64.decode(secret.strip_prefix(SECRET_PREFIX).unwrap_or(secret)).ok()?;
    let key = hmac::Key::new(hmac::HMAC_SHA256, &key);
    let mut ctx = hmac::Context::with_key(&key);
    ctx.update(msg_id.as_bytes());
    ctx.update(b".");
    ctx.update(timestamp.to_string().as_bytes());
    ctx.update(b".");
    ctx.update(body);
    Some(format!("v1,{}", B64.encode(ctx.sign().as_ref())))
}

/// Whether `ip` is a public (globally routable unicast) address. Not public: unspecified,
/// loopback, private (10/8, 172.16/12, 192.168/16), shared (100.64/10), link-local, the
/// IETF/documentation/benchmark blocks, multicast, reserved, broadcast; IPv6 outside 2000::/3,
/// documentation, Teredo, and IPv4-mapped/translated/6to4 addresses whose IPv4 is not public.
pub fn is_public(ip: IpAddr) -> bool {
    match ip {
        IpAddr::V4(v4) => is_public_v4(v4),
        IpAddr::V6(v6) => is_public_v6(v6),
    }
}

fn is_public_v4(ip: Ipv4Addr) -> bool {
    let [a, b, c, _] = ip.octets();
    !(a == 0
        || a == 10
        || a == 127
        || (a == 100 && (64..128).contains(&b))
        || (a == 169 && b == 254)
        || (a == 172 && (16..32).contains(&b))
        || (a == 192 && b == 0 && c == 0)
        || (a == 192 && b == 0 && c == 2)
        || (a == 192 && b == 88 && c == 99)
        || (a == 192 && b == 168)
        || (a == 198 && (18..20).contains(&b))
        || (a == 198 && b == 51 && c == 100)
        || (a == 203 && b == 0 && c == 113)
        || a >= 224)
}

fn is_public_v6(ip: Ipv6Addr) -> bool {
    if let Some(v4) = ip.to_ipv4_mapped() {
        return is_public_v4(v4);
    }
    let s = ip.segments();
    // NAT64 (64:ff9b::/96) embeds an IPv4 address.
    if s[0] == 0x64 && s[1] == 0xff9b && s[2..6] == [0, 0, 0, 0] {
        return is_public_v4(Ipv4Addr::new((s[6] >> 8) as u8, s[6] as u8, (s[7] >> 8) as u8, s[7] as u8));
    }
    // 6to4 (2002::/16) embeds one too.
    if s[0] == 0x2002 {
        return is_public_v4(Ipv4Addr::new((s[1] >> 8) as u8, s[1] as u8, (s[2] >> 8) as u8, s[2] as u8));
    }
    let global_unicast = (s[0] & 0xe000) == 0x2000;
    let documentation = s[0] == 0x2001 && s[1] == 0x0db8;
    let teredo = s[0] == 0x2001 && s[1] == 0;
    global_unicast && !documentation && !teredo
}

/// A refused webhook URL: stable code and message (400 at creation).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct UrlRefused {
    pub code: &'static str,
    pub message: String,
}

/// Checks a webhook URL at creation: absolute `http`/`https` with a host, at most
/// [`MAX_URL_BYTES`], no fragment; a host that is an IP literal or `localhost` must be public
/// unless `allow_private`. (Host names are checked again at every connection, by the delivery
/// client's resolver: what a name resolves to can change.) Codes: `invalid_webhook_url`,
/// `webhook_target_private`.
pub fn validate_url(url: &str, allow_private: bool) -> Result<reqwest::Url, UrlRefused> {
    let invalid = |message: String| UrlRefused { code: "invalid_webhook_url", message };
    if url.len() > MAX_URL_BYTES {
        return Err(invalid(format!("url: at most {MAX_URL_BYTES} bytes")));
    }
    let parsed = reqwest::Url::parse(url.trim()).map_err(|e| invalid(format!("url: not an absolute URL ({e})")))?;
    if !matches!(parsed.scheme(), "http" | "https") {
        return Err(invalid("url: the scheme must be http or https".into()));
    }
    if parsed.host_str().is_none_or(str::is_empty) {
        return Err(invalid("url: a host is required".into()));
    }
    if parsed.fragment().is_some() {
        return Err(invalid("url: no fragment (#...) allowed".into()));
    }
    if !allow_private && let Some(reason) = private_host(&parsed) {
        return Err(UrlRefused {
            code: "webhook_target_private",
            message: format!("url: {reason}; only public addresses may receive webhooks (WEBHOOK_ALLOW_PRIVATE_TARGETS)"),
        });
    }
    Ok(parsed)
}

/// Why `url`'s host is known to be non-public without resolving it, if it is.
fn private_host(url: &reqwest::Url) -> Option<String> {
    // The URL parser already normalised IPv4 forms (`0x7f000001` is `127.0.0.1`).
    let host = url.host_str()?;
    if let Ok(ip) = host.trim_start_matches('[').trim_end_matches(']').parse::<IpAddr>() {
        return (!is_public(ip)).then(|| format!("{ip} is not a public address"));
    }
    let name = host.trim_end_matches('.').to_ascii_lowercase();
    (name == "localhost" || name.ends_with(".localhost")).then(|| format!("{name} is the loopback interface"))
}

/// The resolver of the delivery client: the system's resolver, then only public addresses
/// (unless allowed); a name with none left fails to connect ("refused target").
#[derive(Debug, Clone, Copy)]
struct GuardedResolver {
    allow_private: bool,
}

/// The error of a name that resolved only to non-public addresses.
#[derive(Debug)]
struct PrivateTarget(String);

impl std::fmt::Display for PrivateTarget {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} resolves only to non-public addresses; refused (WEBHOOK_ALLOW_PRIVATE_TARGETS)", self.0)
    }
}

impl std::error::Error for PrivateTarget {}

impl reqwest::dns::Resolve for GuardedResolver {
    fn resolve(&self, name: reqwest::dns::Name) -> reqwest::dns::Resolving {
        let allow_private = self.allow_private;
        let host = name.as_str().to_owned();
        Box::pin(async move {
            let addrs: Vec<SocketAddr> = tokio::net::lookup_host((host.as_str(), 0)).await?.collect();
            let allowed: Vec<SocketAddr> = addrs.into_iter().filter(|a| allow_private || is_public(a.ip())).collect();
            if allowed.is_empty() {
                return Err(Box::new(PrivateTarget(host)) as Box<dyn std::error::Error + Send + Sync>);
            }
            Ok(Box::new(allowed.into_iter()) as reqwest::dns::Addrs)
        })
    }
}

/// Outbound settings of deliveries.
#[derive(Debug, Clone, Copy)]
pub struct ClientSettings {
    /// Bound of one whole attempt (connect, send, answer).
    pub timeout: Duration,
    /// Allow non-public targets.
    pub allow_private: bool,
}

/// The delivery client: no redirects, no proxy, connect timeout min(5 s, timeout), total
/// `timeout`, the guarded resolver. Errors: the client cannot be built.
pub fn client(settings: ClientSettings) -> reqwest::Result<reqwest::Client> {
    crate::tools::http::outbound_client(
        settings.timeout.min(Duration::from_secs(5)),
        settings.timeout,
        Some(settings.timeout),
        reqwest::redirect::Policy::none(),
    )
    .no_proxy()
    .dns_resolver(Arc::new(GuardedResolver { allow_private: settings.allow_private }))
    .user_agent(concat!("agentloop-webhooks/", env!("CARGO_PKG_VERSION")))
    .build()
}

/// The outcome of one attempt, as recorded.
#[derive(Debug, Clone, Default, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "camelCase")]
pub struct AttemptOutcome {
    /// A 2xx answer: delivered.
    pub ok: bool,
    /// The receiver's status, if it answered.
    pub status_code: Option<u16>,
    /// The start of its answer (at most [`MAX_RESPONSE_BODY_BYTES`], lossy UTF-8).
    pub response_body: Option<String>,
    /// Why the attempt did not deliver.
    pub error: Option<String>,
    /// Duration of the attempt in ms.
    pub duration_ms: u64,
}

/// One delivery attempt: `POST url` with `body` (the event JSON) and the Standard Webhooks
/// headers for message `msg_id` signed with `secret`. A 2xx answer is a success; anything else —
/// another status (a redirect is not followed), a refused target, a timeout, a connection error
/// — is a failure the caller retries.
pub async fn send(client: &reqwest::Client, url: &str, msg_id: &str, secret: &str, body: &str, allow_private: bool) -> AttemptOutcome {
    let started = Instant::now();
    let mut outcome = attempt(client, url, msg_id, secret, body, allow_private).await;
    outcome.duration_ms = started.elapsed().as_millis() as u64;
    outcome
}

async fn attempt(client: &reqwest::Client, url: &str, msg_id: &str, secret: &str, body: &str, allow_private: bool) -> AttemptOutcome {
    let failed = |error: String| AttemptOutcome { error: Some(error), ..Default::default() };
    let parsed = match reqwest::Url::parse(url) {
        Ok(parsed) => parsed,
        Err(e) => return failed(format!("invalid url: {e}")),
    };
    if !allow_private && let Some(reason) = private_host(&parsed) {
        return failed(format!("refused target: {reason} (WEBHOOK_ALLOW_PRIVATE_TARGETS)"));
    }
    let timestamp = chrono::Utc::now().timestamp();
    let Some(signature) = sign(secret, msg_id, timestamp, body.as_bytes()) else {
        return failed("the signing secret is malformed".into());
    };
    let request = client
        .post(parsed)
        .header(reqwest::header::CONTENT_TYPE, "application/json")
        .header("webhook-id", msg_id)
        .header("webhook-timestamp", timestamp.to_string())
        .header("webhook-signature", signature)
        .body(body.to_owned());
    let mut response = match request.send().await {
        Ok(response) => response,
        Err(error) => return failed(crate::tools::http::describe(&error)),
    };
    let status = response.status();
    let location = response
        .headers()
        .get(reqwest::header::LOCATION)
        .map(|v| format!(" (Location: {})", String::from_utf8_lossy(&v.as_bytes()[..v.len().min(256)])))
        .unwrap_or_default();
    let mut text = Vec::new();
    let mut read_error = None;
    loop {
        match response.chunk().await {
            Ok(Some(chunk)) => {
                let room = MAX_RESPONSE_BODY_BYTES - text.len();
                text.extend_from_slice(&chunk[..chunk.len().min(room)]);
                if chunk.len() >= room {
                    break;
                }
            }
            Ok(None) => break,
            Err(error) => {
                read_error = Some(crate::tools::http::describe(&error));
                break;
            }
        }
    }
    drop(response);
    let response_body = String::from_utf8_lossy(&text).into_owned();
    let ok = status.is_success();
    let error = if ok {
        None
    } else if status.is_redirection() {
        Some(format!("HTTP {}: redirects are not followed{location}", status.as_u16()))
    } else {
        Some(format!("HTTP {}", status.as_u16()))
    };
    // A 2xx whose body broke off is still a delivery: the receiver accepted it.
    AttemptOutcome {
        ok,
        status_code: Some(status.as_u16()),
        response_body: Some(response_body),
        error: error.or(read_error.filter(|_| !ok)),
        duration_ms: 0,
    }
}

/// Delay before attempt `failed + 1` after `failed` failed attempts: `base * 2^(failed-1)`
/// capped at `max`, with equal jitter (a uniformly random point in its upper half).
pub fn backoff(failed: u32, base: Duration, max: Duration) -> Duration {
    let exp = failed.saturating_sub(1).min(30);
    let full = base.saturating_mul(1u32 << exp).min(max);
    let half = full / 2;
    let jitter = u64::from_le_bytes(random_bytes::<8>()) % (half.as_millis() as u64 + 1);
    half + Duration::from_millis(jitter)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The example of the Standard Webhooks reference libraries' tests.
    #[test]
    fn signatures_match_the_standard_webhooks_example() {
        let secret = "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw";
        let signature = sign(secret, "msg_p5jXN8AQM9LWM0D4loKWxJek", 1614265330, br#"{"test": 2432232314}"#).unwrap();
        assert_eq!(signature, "v1,g0hM9SsE+OTPJTGt/tmIKtSyZlE3uFJELVlNIOLJ1OE=");
    }

    #[test]
    fn secrets_round_trip_sealed_and_only_with_their_key_and_webhook() {
        let secret = new_secret();
        assert!(secret.starts_with("whsec_") && B64.decode(&secret[6..]).unwrap().len() == 32);
        let key = SecretsKey::parse(&B64.encode([7u8; 32])).unwrap();
        let other = SecretsKey::parse(&B64.encode([8u8; 32])).unwrap();
        let id = Uuid::new_v4();
        let stored = seal(&secret, Some(&key), id);
        assert!(stored.starts_with("v1:") && !stored.contains(&secret[6..]));
        assert_eq!(open(&stored, Some(&key), id).unwrap(), secret);
        assert_eq!(open(&stored, Some(&other), id), Err(SecretError::WrongKey));
        assert_eq!(open(&stored, Some(&key), Uuid::new_v4()), Err(SecretError::WrongKey));
        assert_eq!(open(&stored, None, id), Err(SecretError::NoKey));
        assert_eq!(open(&seal(&secret, None, id), Some(&key), id).unwrap(), secret);
        assert!(SecretsKey::parse(&B64.encode([1u8; 16])).is_err());
    }

    #[test]
    fn only_public_addresses_are_public() {
        for ip in ["8.8.8.8", "1.1.1.1", "2606:4700:4700::1111", "::ffff:8.8.8.8", "64:ff9b::808:808"] {
            assert!(is_public(ip.parse().unwrap()), "{ip}");
        }
        for ip in [
            "127.0.0.1", "10.1.2.3", "172.16.0.1", "172.31.255.255", "192.168.1.1", "169.254.169.254", "100.64.0.1", "0.0.0.0",
            "224.0.0.1", "255.255.255.255", "198.18.0.1", "192.0.2.1", "::1", "::", "fe80::1", "fc00::1", "fd12::1", "ff02::1",
            "::ffff:127.0.0.1", "::ffff:10.0.0.1", "64:ff9b::7f00:1", "2002:7f00:1::", "2001:db8::1", "2001::1",
        ] {
            assert!(!is_public(ip.parse().unwrap()), "{ip}");
        }
    }

    #[test]
    fn urls_are_checked() {
        assert!(validate_url("https://hooks.example.com/x?token=1", false).is_ok());
        assert!(validate_url("http://127.0.0.1:9000/hook", true).is_ok());
        for (url, code) in [
            ("ftp://example.com/x", "invalid_webhook_url"),
            ("not a url", "invalid_webhook_url"),
            ("https://example.com/#frag", "invalid_webhook_url"),
            ("http://127.0.0.1:9000/hook", "webhook_target_private"),
            ("http://[::1]/hook", "webhook_target_private"),
            ("http://169.254.169.254/latest/meta-data", "webhook_target_private"),
            ("http://localhost:8080/", "webhook_target_private"),
            ("http://0x7f000001/", "webhook_target_private"),
        ] {
            assert_eq!(validate_url(url, false).unwrap_err().code, code, "{url}");
        }
        assert!(validate_url(&format!("https://example.com/{}", "a".repeat(MAX_URL_BYTES)), false).is_err());
    }

    #[tokio::test]
    async fn the_resolver_refuses_names_of_non_public_addresses() {
        use reqwest::dns::Resolve;
        let name = || "localhost".parse::<reqwest::dns::Name>().unwrap();
        let refused = GuardedResolver { allow_private: false }.resolve(name()).await.err().expect("refused");
        assert!(refused.to_string().contains("non-public"), "{refused}");
        let allowed: Vec<SocketAddr> = GuardedResolver { allow_private: true }.resolve(name()).await.unwrap().collect();
        assert!(allowed.iter().any(|a| a.ip().is_loopback()), "{allowed:?}");
    }

    /// A raw HTTP server: answers `/redirect` with a 302 to the metadata address, anything else
    /// with a 500 carrying 5000 bytes.
    async fn raw_server() -> SocketAddr {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        tokio::spawn(async move {
            while let Ok((mut stream, _)) = listener.accept().await {
                tokio::spawn(async move {
                    let mut request = Vec::new();
                    let mut buf = [0u8; 4096];
                    while let Ok(Ok(n)) = tokio::time::timeout(Duration::from_millis(200), stream.read(&mut buf)).await {
                        if n == 0 {
                            break;
                        }
                        request.extend_from_slice(&buf[..n]);
                    }
                    let answer = if request.starts_with(b"POST /redirect") {
                        "HTTP/1.1 302 Found\r\nConnection: close\r\nLocation: http://169.254.169.254/\r\nContent-Length: 0\r\n\r\n".to_owned()
                    } else {
                        format!("HTTP/1.1 500 Internal Server Error\r\nConnection: close\r\nContent-Length: 5000\r\n\r\n{}", "x".repeat(5000))
                    };
                    let _ = stream.write_all(answer.as_bytes()).await;
                });
            }
        });
        addr
    }

    #[tokio::test]
    async fn redirects_are_not_followed_answers_are_capped_and_private_targets_refused() {
        let addr = raw_server().await;
        let settings = ClientSettings { timeout: Duration::from_secs(5), allow_private: true };
        let client = client(settings).unwrap();
        let secret = new_secret();
        let redirect = send(&client, &format!("http://{addr}/redirect"), "msg_1", &secret, "{}", true).await;
        assert!(!redirect.ok && redirect.status_code == Some(302), "{redirect:?}");
        assert!(redirect.error.as_deref().is_some_and(|e| e.contains("not followed") && e.contains("169.254.169.254")), "{redirect:?}");
        let big = send(&client, &format!("http://{addr}/big"), "msg_1", &secret, "{}", true).await;
        assert_eq!((big.ok, big.status_code), (false, Some(500)));
        assert_eq!(big.response_body.as_deref().map(str::len), Some(MAX_RESPONSE_BODY_BYTES));
        let strict = super::client(ClientSettings { allow_private: false, ..settings }).unwrap();
        let refused = send(&strict, &format!("http://{addr}/x"), "msg_1", &secret, "{}", false).await;
        assert!(refused.status_code.is_none() && refused.error.as_deref().is_some_and(|e| e.contains("refused target")), "{refused:?}");
        let by_name = send(&strict, &format!("http://localhost.:{}/x", addr.port()), "msg_1", &secret, "{}", false).await;
        assert!(by_name.status_code.is_none() && by_name.error.is_some(), "{by_name:?}");
    }

    #[test]
    fn backoff_doubles_with_jitter_up_to_the_cap() {
        let base = Duration::from_secs(10);
        let max = Duration::from_secs(3600);
        for failed in 1..12u32 {
            let d = backoff(failed, base, max);
            let full = (base * 2u32.pow(failed - 1)).min(max);
            assert!(d >= full / 2 && d <= full, "{failed}: {d:?} vs {full:?}");
        }
    }
}
