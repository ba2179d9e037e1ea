//! The model catalog: which OpenAI-compatible endpoints exist, under which ids, with which
//! limits and capabilities (SPEC §13 "Models are configured in a models file ... or, for a
//! single model, by environment").

use std::{fmt, path::Path, path::PathBuf};

use serde::{Deserialize, Serialize};

/// Provider family; selects projection repairs (SPEC §9: GLM-style providers are strict).
///
/// Serialized lowercase (`"openai"`, `"glm"`, `"mistral"`, `"llama"`, `"other"`); any unknown
/// value reads as [`ModelFamily::Other`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum ModelFamily {
    /// OpenAI and faithful clones.
    OpenAi,
    /// Zhipu GLM: strict message ordering and tool-envelope rules.
    Glm,
    /// Mistral: tool-call ids and ordering are validated strictly.
    Mistral,
    /// Llama-family servers (llama.cpp, vLLM with Llama templates, Ollama).
    Llama,
    /// Anything else; no family-specific behaviour.
    #[default]
    #[serde(other)]
    Other,
}

impl ModelFamily {
    /// Guesses the family from a model name (case-insensitive substrings `gpt`/`o1`/`o3`/`o4`,
    /// `glm`, `mistral`/`mixtral`/`codestral`, `llama`); [`ModelFamily::Other`] otherwise.
    pub fn from_model_name(name: &str) -> Self {
        let name = name.to_ascii_lowercase();
        let has = |needles: &[&str]| needles.iter().any(|n| name.contains(n));
        if has(&["glm"]) {
            Self::Glm
        } else if has(&["mistral", "mixtral", "codestral"]) {
            Self::Mistral
        } else if has(&["llama"]) {
            Self::Llama
        } else if has(&["gpt", "o1", "o3", "o4"]) {
            Self::OpenAi
        } else {
            Self::Other
        }
    }
}

/// One callable model. Serialized (camelCase) without its secret, e.g. for `GET /api/models`.
#[derive(Clone, PartialEq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct ModelConfig {
    /// Id clients and thread metadata use to select this model.
    pub id: String,
    /// Base URL of the OpenAI-compatible API, up to and including `/v1`
    /// (e.g. `http://127.0.0.1:9000/v1`); `/chat/completions` is appended.
    pub base_url: String,
    /// Name of the environment variable the API key was read from, if any.
    pub api_key_env: Option<String>,
    /// The resolved API key, sent as a bearer token. Never serialized, redacted in `Debug`.
    #[serde(skip)]
    pub api_key: Option<String>,
    /// Model name sent upstream in the request's `model` field.
    pub upstream_name: String,
    /// Context window in tokens, if known (compaction threshold is 80% of it, SPEC §12).
    pub context_tokens: Option<u32>,
    /// Accepted input modalities, e.g. `["text"]` or `["text", "image"]`.
    pub input_modalities: Vec<String>,
    /// Whether the model accepts `tools`; when false the client never sends any.
    pub supports_tools: bool,
    /// Provider family (projection repairs).
    pub family: ModelFamily,
}

impl fmt::Debug for ModelConfig {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ModelConfig")
            .field("id", &self.id)
            .field("base_url", &self.base_url)
            .field("api_key_env", &self.api_key_env)
            .field("api_key", &self.api_key.as_ref().map(|_| "[redacted]"))
            .field("upstream_name", &self.upstream_name)
            .field("context_tokens", &self.context_tokens)
            .field("input_modalities", &self.input_modalities)
            .field("supports_tools", &self.supports_tools)
            .field("family", &self.family)
            .finish()
    }
}

/// Errors loading the catalog; all are start-up configuration errors.
#[derive(Debug, thiserror::Error)]
pub enum CatalogError {
    /// Neither `--models-file` nor `--model-base-url` was given.
    #[error("no model configured: set MODELS_FILE or MODEL_BASE_URL")]
    NotConfigured,
    /// The models file could not be read.
    #[error("cannot read models file {path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    /// The models file is not valid JSON of the documented shape.
    #[error("invalid models file {path}: {source}")]
    Parse {
        path: PathBuf,
        #[source]
        source: serde_json::Error,
    },
    /// A model names an API-key environment variable that is unset or empty.
    #[error("model {model}: environment variable {env} (its API key) is not set")]
    MissingApiKey { model: String, env: String },
    /// Semantically invalid content: no models, an empty field, a duplicate id.
    #[error("invalid model catalog: {0}")]
    Invalid(String),
}

/// The configured models; the first one is the default.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ModelCatalog {
    /// Models in configuration order.
    pub models: Vec<ModelConfig>,
}

/// One entry of the models file, before its key is resolved.
#[derive(Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
struct ModelEntry {
    id: String,
    base_url: String,
    api_key_env: Option<String>,
    upstream_name: Option<String>,
    context_tokens: Option<u32>,
    input_modalities: Option<Vec<String>>,
    supports_tools: Option<bool>,
    family: Option<ModelFamily>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct ModelsFile {
    models: Vec<ModelEntry>,
}

impl ModelCatalog {
    /// The default model (the first configured); `None` only for a hand-built empty catalog.
    pub fn default_model(&self) -> Option<&ModelConfig> {
        self.models.first()
    }

    /// The model with this id.
    pub fn get(&self, id: &str) -> Option<&ModelConfig> {
        self.models.iter().find(|m| m.id == id)
    }

    /// Loads a models file:
    /// `{"models":[{"id","baseUrl","apiKeyEnv"?,"upstreamName"?,"contextTokens"?,
    /// "inputModalities"?,"supportsTools"?,"family"?}]}`.
    ///
    /// Defaults: `upstreamName` = `id`, `inputModalities` = `["text"]`, `supportsTools` = true,
    /// `family` guessed from the upstream name ([`ModelFamily::from_model_name`]). Each
    /// `apiKeyEnv` is resolved now.
    ///
    /// Errors: [`CatalogError::Io`], [`CatalogError::Parse`] (including unknown fields),
    /// [`CatalogError::MissingApiKey`], [`CatalogError::Invalid`] (no models, empty id or URL,
    /// duplicate id).
    pub fn from_file(path: &Path) -> Result<Self, CatalogError> {
        let text = std::fs::read_to_string(path).map_err(|source| CatalogError::Io {
            path: path.to_owned(),
            source,
        })?;
        let file: ModelsFile =
            serde_json::from_str(&text).map_err(|source| CatalogError::Parse {
                path: path.to_owned(),
                source,
            })?;
        let models = file
            .models
            .into_iter()
            .map(|entry| {
                let api_key = match &entry.api_key_env {
                    Some(env) => Some(
                        std::env::var(env)
                            .ok()
                            .filter(|key| !key.is_empty())
                            .ok_or_else(|| CatalogError::MissingApiKey {
                                model: entry.id.clone(),
                                env: env.clone(),
                            })?,
                    ),
                    None => None,
                };
                let upstream_name = entry.upstream_name.unwrap_or_else(|| entry.id.clone());
                Ok(ModelConfig {
                    family: entry
                        .family
                        .unwrap_or_else(|| ModelFamily::from_model_name(&upstream_name)),
                    id: entry.id,
                    base_url: entry.base_url,
                    api_key_env: entry.api_key_env,
                    api_key,
                    upstream_name,
                    context_tokens: entry.context_tokens,
                    input_modalities: entry
                        .input_modalities
                        .unwrap_or_else(|| vec!["text".to_owned()]),
                    supports_tools: entry.supports_tools.unwrap_or(true),
                })
            })
            .collect::<Result<Vec<_>, CatalogError>>()?;
        Self::validated(models)
    }

    /// A one-model catalog from `MODEL_BASE_URL`, `MODEL_API_KEY`, `MODEL_NAME`,
    /// `MODEL_CONTEXT_TOKENS`: id and upstream name are `name`, text only, tools supported,
    /// family guessed from `name`. An empty `api_key` counts as none.
    ///
    /// Errors: [`CatalogError::Invalid`] if `base_url` or `name` is empty.
    pub fn from_env_vars(
        base_url: &str,
        api_key: Option<&str>,
        name: &str,
        context_tokens: Option<u32>,
    ) -> Result<Self, CatalogError> {
        Self::validated(vec![ModelConfig {
            id: name.to_owned(),
            base_url: base_url.to_owned(),
            api_key_env: None,
            api_key: api_key.filter(|k| !k.is_empty()).map(str::to_owned),
            upstream_name: name.to_owned(),
            context_tokens,
            input_modalities: vec!["text".to_owned()],
            supports_tools: true,
            family: ModelFamily::from_model_name(name),
        }])
    }

    fn validated(mut models: Vec<ModelConfig>) -> Result<Self, CatalogError> {
        if models.is_empty() {
            return Err(CatalogError::Invalid("no models".into()));
        }
        for (i, model) in models.iter_mut().enumerate() {
            if model.id.trim().is_empty() || model.upstream_name.trim().is_empty() {
                return Err(CatalogError::Invalid(format!(
                    "model #{i}: empty id or name"
                )));
            }
            let trimmed = model.base_url.trim().trim_end_matches('/');
            if !(trimmed.starts_with("http://") || trimmed.starts_with("https://")) {
                return Err(CatalogError::Invalid(format!(
                    "model {}: base URL must start with http:// or https://",
                    model.id
                )));
            }
            model.base_url = trimmed.to_owned();
        }
        for (i, model) in models.iter().enumerate() {
            if models[..i].iter().any(|m| m.id == model.id) {
                return Err(CatalogError::Invalid(format!(
                    "duplicate model id {}",
                    model.id
                )));
            }
        }
        Ok(Self { models })
    }
}

/// Model options both binaries flatten. `--models-file` wins over the single-model options.
#[derive(Clone, clap::Args)]
pub struct ModelArgs {
    /// JSON models file: {"models":[{"id","baseUrl","apiKeyEnv","upstreamName","contextTokens",
    /// "inputModalities","supportsTools","family"}]}; the first model is the default.
    #[arg(long, env = "MODELS_FILE")]
    pub models_file: Option<PathBuf>,

    /// Base URL of a single OpenAI-compatible model, e.g. http://127.0.0.1:9000/v1.
    #[arg(long, env = "MODEL_BASE_URL")]
    pub model_base_url: Option<String>,

    /// API key of the single model (sent as a bearer token).
    #[arg(long, env = "MODEL_API_KEY", hide_env_values = true)]
    pub model_api_key: Option<String>,

    /// Name of the single model: its id here and the upstream `model` field.
    #[arg(long, env = "MODEL_NAME", default_value = "default")]
    pub model_name: String,

    /// Context window of the single model, in tokens.
    #[arg(long, env = "MODEL_CONTEXT_TOKENS", value_parser = clap::value_parser!(u32).range(256..))]
    pub model_context_tokens: Option<u32>,

    /// Whether the single model accepts tools (`GET /api/models` `supportsTools`; without it no
    /// tool is ever offered). `deploy/real-model.sh` sets it from what the llama.cpp server
    /// reports for its chat template (`GET /props` `chat_template_caps.supports_tools`).
    #[arg(long, env = "MODEL_SUPPORTS_TOOLS", default_value_t = true, action = clap::ArgAction::Set)]
    pub model_supports_tools: bool,
}

impl fmt::Debug for ModelArgs {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ModelArgs")
            .field("models_file", &self.models_file)
            .field("model_base_url", &self.model_base_url)
            .field(
                "model_api_key",
                &self.model_api_key.as_ref().map(|_| "[redacted]"),
            )
            .field("model_name", &self.model_name)
            .field("model_context_tokens", &self.model_context_tokens)
            .field("model_supports_tools", &self.model_supports_tools)
            .finish()
    }
}

impl ModelArgs {
    /// Builds the catalog: [`ModelCatalog::from_file`] if `--models-file` is set, else
    /// [`ModelCatalog::from_env_vars`] if `--model-base-url` is set, else
    /// [`CatalogError::NotConfigured`].
    pub fn catalog(&self) -> Result<ModelCatalog, CatalogError> {
        match (&self.models_file, &self.model_base_url) {
            (Some(path), _) => ModelCatalog::from_file(path),
            (None, Some(base_url)) => ModelCatalog::from_env_vars(
                base_url,
                self.model_api_key.as_deref(),
                &self.model_name,
                self.model_context_tokens,
            )
            .map(|mut catalog| {
                for model in &mut catalog.models {
                    model.supports_tools = self.model_supports_tools;
                }
                catalog
            }),
            (None, None) => Err(CatalogError::NotConfigured),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn write_file(json: &str) -> PathBuf {
        let path =
            std::env::temp_dir().join(format!("agentloop-models-{}.json", uuid::Uuid::new_v4()));
        std::fs::write(&path, json).unwrap();
        path
    }

    #[test]
    fn file_defaults_family_and_unknown_family() {
        let path = write_file(
            r#"{"models":[
              {"id":"fast","baseUrl":"http://127.0.0.1:9000/v1/","upstreamName":"glm-4.6","contextTokens":128000},
              {"id":"vision","baseUrl":"https://example.test/v1","inputModalities":["text","image"],
               "supportsTools":false,"family":"quantum"}]}"#,
        );
        let catalog = ModelCatalog::from_file(&path).unwrap();
        std::fs::remove_file(&path).unwrap();
        let fast = catalog.default_model().unwrap();
        assert_eq!(fast.id, "fast");
        assert_eq!(fast.base_url, "http://127.0.0.1:9000/v1");
        assert_eq!(fast.family, ModelFamily::Glm);
        assert_eq!(fast.input_modalities, ["text"]);
        assert!(fast.supports_tools);
        let vision = catalog.get("vision").unwrap();
        assert_eq!(vision.upstream_name, "vision");
        assert_eq!(vision.family, ModelFamily::Other);
        assert!(!vision.supports_tools);
        assert!(catalog.get("nope").is_none());
    }

    #[test]
    fn file_errors() {
        let missing_key = write_file(
            r#"{"models":[{"id":"a","baseUrl":"http://x/v1","apiKeyEnv":"AGENTLOOP_TEST_UNSET_KEY_VAR"}]}"#,
        );
        let duplicate = write_file(
            r#"{"models":[{"id":"a","baseUrl":"http://x/v1"},{"id":"a","baseUrl":"http://y/v1"}]}"#,
        );
        let typo = write_file(r#"{"models":[{"id":"a","base_url":"http://x/v1"}]}"#);
        let results = [&missing_key, &duplicate, &typo].map(|p| ModelCatalog::from_file(p));
        for p in [&missing_key, &duplicate, &typo] {
            std::fs::remove_file(p).unwrap();
        }
        assert!(matches!(
            results[0],
            Err(CatalogError::MissingApiKey { .. })
        ));
        assert!(matches!(results[1], Err(CatalogError::Invalid(_))));
        assert!(matches!(results[2], Err(CatalogError::Parse { .. })));
        assert!(matches!(
            ModelCatalog::from_file(Path::new("/nonexistent/models.json")),
            Err(CatalogError::Io { .. })
        ));
    }

    #[test]
    fn env_vars_and_secret_hygiene() {
        let catalog = ModelCatalog::from_env_vars(
            "http://127.0.0.1:9/v1",
            Some("sk-secret"),
            "m",
            Some(4096),
        )
        .unwrap();
        let model = catalog.default_model().unwrap();
        assert_eq!(
            (model.id.as_str(), model.upstream_name.as_str()),
            ("m", "m")
        );
        assert_eq!(model.api_key.as_deref(), Some("sk-secret"));
        assert!(!format!("{model:?}").contains("sk-secret"));
        assert!(
            !serde_json::to_string(&catalog)
                .unwrap()
                .contains("sk-secret")
        );
        assert!(ModelCatalog::from_env_vars("", None, "m", None).is_err());
    }

    #[test]
    fn args_require_a_source() {
        use clap::Parser;
        #[derive(Parser)]
        struct Cli {
            #[command(flatten)]
            model: ModelArgs,
        }
        let cli = Cli::try_parse_from([
            "x",
            "--model-base-url",
            "http://h/v1",
            "--model-api-key",
            "k",
        ])
        .unwrap();
        assert_eq!(cli.model.catalog().unwrap().models[0].id, "default");
        assert!(!format!("{:?}", cli.model).contains("\"k\""));
        let none = ModelArgs {
            models_file: None,
            model_base_url: None,
            model_api_key: None,
            model_name: "default".into(),
            model_context_tokens: None,
            model_supports_tools: true,
        };
        assert!(matches!(none.catalog(), Err(CatalogError::NotConfigured)));
    }
}
