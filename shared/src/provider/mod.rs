//! Model access: the catalog of configured OpenAI-compatible models and the streaming client
//! that calls them. No database access here.

pub mod catalog;
pub mod client;
pub mod projection;

pub use catalog::{CatalogError, ModelArgs, ModelCatalog, ModelConfig, ModelFamily};
pub use client::{
    AssistantTurn, ChatRequest, ProviderClient, ProviderError, StreamDelta, ToolCall, Usage,
};
