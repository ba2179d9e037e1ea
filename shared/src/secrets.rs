//! Secrets at rest: AES-256-GCM sealing under an operator's key, shared by the webhooks' signing
//! secrets (`WEBHOOK_SECRETS_KEY`, [`crate::webhooks`]) and the MCP sign-in tokens and PKCE
//! verifiers (`OAUTH_TOKENS_KEY`, [`crate::mcp_auth`]).
//!
//! A sealed value is `v1:<base64(nonce || ciphertext || tag)>` with a random 96-bit nonce and
//! caller-chosen additional data (AAD) that binds it to its owner (a webhook id; a principal and
//! an MCP server): a stored value copied to another owner cannot be opened. Without a key a
//! value is stored as `plain:<text>` — only where the caller allows that (webhooks do; MCP tokens
//! are never stored without a key).

use base64::Engine;
use base64::engine::general_purpose::STANDARD as B64;
use ring::aead;
use ring::rand::SecureRandom;

/// An AES-256-GCM key for values at rest.
pub struct SecretsKey(aead::LessSafeKey);

impl std::fmt::Debug for SecretsKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("SecretsKey(..)")
    }
}

impl SecretsKey {
    /// Parses base64 of exactly 32 bytes; `name` (the setting, e.g. `WEBHOOK_SECRETS_KEY`)
    /// names it in the error.
    pub fn parse_named(text: &str, name: &str) -> anyhow::Result<Self> {
        let bytes = B64.decode(text.trim()).map_err(|_| anyhow::anyhow!("{name} is not base64"))?;
        anyhow::ensure!(bytes.len() == 32, "{name} must be 32 bytes (base64 of 32 random bytes), not {}", bytes.len());
        let key = aead::UnboundKey::new(&aead::AES_256_GCM, &bytes).map_err(|_| anyhow::anyhow!("invalid {name}"))?;
        Ok(Self(aead::LessSafeKey::new(key)))
    }

    /// Parses base64 of exactly 32 bytes (errors name `WEBHOOK_SECRETS_KEY`).
    pub fn parse(text: &str) -> anyhow::Result<Self> {
        Self::parse_named(text, "WEBHOOK_SECRETS_KEY")
    }
}

/// Why a stored value cannot be opened.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OpenError {
    /// Sealed, but no key is configured.
    NoKey,
    /// The key (or the additional data) differs from the one it was sealed with.
    WrongKey,
    /// Not a stored value.
    Malformed,
}

/// `N` bytes from the system's random generator.
pub fn random_bytes<const N: usize>() -> [u8; N] {
    let mut bytes = [0u8; N];
    ring::rand::SystemRandom::new().fill(&mut bytes).expect("the system's random generator");
    bytes
}

/// The stored form of `secret` bound to `aad`: `v1:<base64(nonce || ciphertext || tag)>` with a
/// key, `plain:<secret>` without.
pub fn seal(secret: &str, key: Option<&SecretsKey>, aad: &[u8]) -> String {
    let Some(key) = key else { return format!("plain:{secret}") };
    let nonce = random_bytes::<12>();
    let mut data = secret.as_bytes().to_vec();
    key.0
        .seal_in_place_append_tag(aead::Nonce::assume_unique_for_key(nonce), aead::Aad::from(aad), &mut data)
        .expect("AES-GCM sealing a short secret");
    let mut out = nonce.to_vec();
    out.extend_from_slice(&data);
    format!("v1:{}", B64.encode(out))
}

/// The secret of a stored form made by [`seal`] with the same `aad`.
pub fn open(stored: &str, key: Option<&SecretsKey>, aad: &[u8]) -> Result<String, OpenError> {
    if let Some(plain) = stored.strip_prefix("plain:") {
        return Ok(plain.to_owned());
    }
    let sealed = stored.strip_prefix("v1:").ok_or(OpenError::Malformed)?;
    let key = key.ok_or(OpenError::NoKey)?;
    let mut bytes = B64.decode(sealed).map_err(|_| OpenError::Malformed)?;
    if bytes.len() < 12 + aead::AES_256_GCM.tag_len() {
        return Err(OpenError::Malformed);
    }
    let mut data = bytes.split_off(12);
    let nonce = aead::Nonce::try_assume_unique_for_key(&bytes).map_err(|_| OpenError::Malformed)?;
    let plain = key.0.open_in_place(nonce, aead::Aad::from(aad), &mut data).map_err(|_| OpenError::WrongKey)?;
    String::from_utf8(plain.to_vec()).map_err(|_| OpenError::Malformed)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sealed_values_open_only_with_their_key_and_aad() {
        let key = SecretsKey::parse(&B64.encode([7u8; 32])).unwrap();
        let other = SecretsKey::parse(&B64.encode([8u8; 32])).unwrap();
        let stored = seal("tok", Some(&key), b"a");
        assert!(stored.starts_with("v1:"));
        assert_eq!(open(&stored, Some(&key), b"a"), Ok("tok".into()));
        assert_eq!(open(&stored, Some(&key), b"b"), Err(OpenError::WrongKey));
        assert_eq!(open(&stored, Some(&other), b"a"), Err(OpenError::WrongKey));
        assert_eq!(open(&stored, None, b"a"), Err(OpenError::NoKey));
        assert_eq!(open("x", Some(&key), b"a"), Err(OpenError::Malformed));
    }
}
