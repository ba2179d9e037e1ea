//! OpenAPI entries of issue 12's routes (parts 1, 3, 4): `/v1/chat/completions`, `/v1/models`,
//! `/v1/models/{id}`, `POST /api/threads/import`, `/mcp` — typed bodies (`utoipa::ToSchema`),
//! every status each can send, OpenAI's error envelope on `/v1/*` and the API's elsewhere.
//! Applied by [`Protocols`] after `openapi::RouteTable`.

use serde::{Deserialize, Serialize};
use serde_json::Value;
use utoipa::openapi::path::{HttpMethod, OperationBuilder, ParameterBuilder, ParameterIn};
use utoipa::openapi::request_body::RequestBodyBuilder;
use utoipa::openapi::security::SecurityRequirement;
use utoipa::openapi::{Content, Ref, Required, ResponseBuilder};
use utoipa::{Modify, OpenApi, ToSchema};

use crate::routes::openai::chat_completions::{ChatCompletionRequest, StreamOptions};
use crate::routes::openai::list_models::{OpenAiModel, OpenAiModelList};
use crate::routes::threads::import_thread::ImportResult;

/// OpenAI's error envelope (every error of `/v1/*`).
#[derive(Debug, Serialize, ToSchema)]
pub struct OpenAiError {
    pub error: OpenAiErrorBody,
}

/// `{message, type, param, code}`.
#[derive(Debug, Serialize, ToSchema)]
pub struct OpenAiErrorBody {
    pub message: String,
    /// `invalid_request_error`, `authentication_error`, `not_found_error`, `server_error`, ...
    #[serde(rename = "type")]
    pub kind: String,
    /// JSON path of the offending request field, e.g. `messages[0].role`.
    pub param: Option<String>,
    /// Stable code: `invalid_messages`, `invalid_api_key`, `model_not_found`, ...
    pub code: Option<String>,
}

/// A function call (`arguments` is JSON text).
#[derive(Debug, Serialize, ToSchema)]
pub struct FunctionCall {
    pub name: String,
    pub arguments: String,
}

/// A client-side tool call returned to the caller.
#[derive(Debug, Serialize, ToSchema)]
pub struct ToolCall {
    pub id: String,
    /// Always `function`.
    #[serde(rename = "type")]
    pub kind: String,
    pub function: FunctionCall,
}

/// The assistant message of a completion.
#[derive(Debug, Serialize, ToSchema)]
pub struct CompletionMessage {
    /// Always `assistant`.
    pub role: String,
    /// Every assistant text of the run, joined by a blank line; null with only tool calls.
    pub content: Option<String>,
    pub refusal: Option<String>,
    /// Client-side calls (with `finish_reason: "tool_calls"`).
    pub tool_calls: Option<Vec<ToolCall>>,
}

/// One choice (`index` 0).
#[derive(Debug, Serialize, ToSchema)]
pub struct CompletionChoice {
    pub index: i32,
    pub message: CompletionMessage,
    pub logprobs: Option<Value>,
    /// `stop` | `tool_calls`.
    pub finish_reason: String,
}

/// Token usage of the run (all its model calls).
#[derive(Debug, Serialize, ToSchema)]
pub struct CompletionUsage {
    pub prompt_tokens: i64,
    pub completion_tokens: i64,
    pub total_tokens: i64,
}

/// `chat.completion` (non-streaming answer).
#[derive(Debug, Serialize, ToSchema)]
pub struct ChatCompletion {
    /// `chatcmpl-<run id>`.
    pub id: String,
    /// Always `chat.completion`.
    pub object: String,
    /// Unix seconds.
    pub created: i64,
    pub model: String,
    pub system_fingerprint: Option<String>,
    pub choices: Vec<CompletionChoice>,
    pub usage: CompletionUsage,
}

/// One `data:` event of a streaming answer: a `chat.completion.chunk` (`choices[0].delta` with
/// `role`, `content` or `tool_calls`; `finish_reason` on the last; `choices: []` and `usage` on
/// the usage chunk), then `data: [DONE]`; a failed run sends `{"error": {...}}` instead.
#[derive(Debug, Serialize, ToSchema)]
pub struct ChatCompletionChunk {
    pub id: String,
    /// Always `chat.completion.chunk`.
    pub object: String,
    pub created: i64,
    pub model: String,
    #[schema(value_type = Vec<Object>)]
    pub choices: Vec<Value>,
    pub usage: Option<CompletionUsage>,
}

/// A message of agentloop's export (`agentloop.thread.v1`).
#[derive(Debug, Deserialize, ToSchema)]
#[serde(rename_all = "camelCase")]
pub struct ExportMessage {
    /// `system` | `developer` | `user` | `assistant` | `tool`.
    pub role: String,
    /// A string or an array of content parts.
    #[schema(value_type = Object)]
    pub content: Value,
    #[schema(value_type = Option<Vec<Object>>)]
    pub tool_calls: Option<Value>,
    pub tool_call_id: Option<String>,
    pub reasoning: Option<String>,
    pub stopped: Option<bool>,
    /// RFC 3339.
    pub created_at: Option<String>,
}

/// The thread of agentloop's export.
#[derive(Debug, Deserialize, ToSchema)]
#[serde(rename_all = "camelCase")]
pub struct ExportThread {
    pub id: Option<String>,
    pub title: Option<String>,
    pub model: Option<String>,
    #[schema(value_type = Option<Object>)]
    pub metadata: Option<Value>,
    pub created_at: Option<String>,
}

/// agentloop's export document (`GET /api/threads/{id}/export`).
#[derive(Debug, Deserialize, ToSchema)]
pub struct AgentloopExport {
    /// `agentloop.thread.v1`.
    pub format: String,
    pub thread: Option<ExportThread>,
    pub messages: Vec<ExportMessage>,
}

/// OpenAI chat messages with an optional title and model.
#[derive(Debug, Deserialize, ToSchema)]
pub struct OpenAiImport {
    #[schema(value_type = Vec<Object>)]
    pub messages: Vec<Value>,
    pub title: Option<String>,
    pub model: Option<String>,
}

/// A ServiceStack llms.py / AI.Chat thread (`messages[].timestamp` in epoch ms), or its export
/// file `{"source": "llmspy", "threads": [thread]}` with one thread.
#[derive(Debug, Deserialize, ToSchema)]
#[serde(rename_all = "camelCase")]
pub struct LlmspyThread {
    #[schema(value_type = Option<Object>)]
    pub id: Option<Value>,
    pub title: Option<String>,
    pub model: Option<String>,
    pub system_prompt: Option<String>,
    #[schema(value_type = Option<Object>)]
    pub created_at: Option<Value>,
    #[schema(value_type = Option<Vec<Object>>)]
    pub messages: Option<Vec<Value>>,
    #[schema(value_type = Option<Vec<Object>>)]
    pub threads: Option<Vec<Value>>,
}

/// The body of `POST /api/threads/import`: one of the accepted documents.
#[derive(Debug, Deserialize, ToSchema)]
#[serde(untagged)]
pub enum ImportDocument {
    Agentloop(AgentloopExport),
    OpenAi(OpenAiImport),
    Llmspy(LlmspyThread),
    /// A bare OpenAI messages array.
    #[schema(value_type = Vec<Object>)]
    Messages(Vec<Value>),
}

/// A JSON-RPC message of MCP (request, notification, or a batch element).
#[derive(Debug, Deserialize, ToSchema)]
pub struct JsonRpcMessage {
    /// `2.0`.
    pub jsonrpc: String,
    #[schema(value_type = Option<Object>)]
    pub id: Option<Value>,
    pub method: Option<String>,
    #[schema(value_type = Option<Object>)]
    pub params: Option<Value>,
}

#[derive(OpenApi)]
#[openapi(components(schemas(
    ChatCompletionRequest, StreamOptions, ChatCompletion, ChatCompletionChunk, CompletionChoice, CompletionMessage,
    CompletionUsage, ToolCall, FunctionCall, OpenAiError, OpenAiErrorBody, OpenAiModel, OpenAiModelList, ImportDocument,
    AgentloopExport, ExportThread, ExportMessage, OpenAiImport, LlmspyThread, ImportResult, JsonRpcMessage
)))]
struct ProtocolSchemas;

/// Adds the routes of issue 12 (see the module docs).
pub struct Protocols;

fn json(schema: &str) -> Content {
    Content::new(Some(Ref::from_schema_name(schema)))
}

fn response(description: &str, media: &str, schema: &str) -> utoipa::openapi::Response {
    ResponseBuilder::new().description(description).content(media, json(schema)).build()
}

fn errors(mut op: OperationBuilder, statuses: &[(&str, &str)], envelope: &str) -> OperationBuilder {
    for (status, description) in statuses {
        op = op.response(*status, response(description, "application/json", envelope));
    }
    op
}

fn bearer() -> SecurityRequirement {
    SecurityRequirement::new("bearer", Vec::<String>::new())
}

impl Modify for Protocols {
    fn modify(&self, openapi: &mut utoipa::openapi::OpenApi) {
        let schemas = ProtocolSchemas::openapi();
        if let (Some(mine), Some(components)) = (schemas.components, openapi.components.as_mut()) {
            components.schemas.extend(mine.schemas);
        }
        let v1_errors: &[(&str, &str)] = &[("401", "Invalid API key (`invalid_api_key`)"), ("503", "Database unavailable")];

        let op = OperationBuilder::new()
            .operation_id(Some("chat_completions"))
            .tag("openai")
            .summary(Some("OpenAI-compatible chat completion through the durable loop (stream, client-side tools, `Idempotency-Key`)"))
            .parameter(
                ParameterBuilder::new()
                    .name("Idempotency-Key")
                    .parameter_in(ParameterIn::Header)
                    .required(Required::False)
                    .description(Some("A resend with the same key attaches to the request's run in flight or gets its recorded outcome (`Idempotent-Replayed: true`)"))
                    .schema(Some(utoipa::openapi::schema::ObjectBuilder::new().schema_type(utoipa::openapi::schema::Type::String))),
            )
            .request_body(Some(
                RequestBodyBuilder::new().required(Some(Required::True)).content("application/json", json("ChatCompletionRequest")).build(),
            ))
            .response(
                "200",
                ResponseBuilder::new()
                    .description("`chat.completion`, or with `stream: true` server-sent `chat.completion.chunk` events ending with `data: [DONE]`")
                    .content("application/json", json("ChatCompletion"))
                    .content("text/event-stream", json("ChatCompletionChunk"))
                    .build(),
            )
            .security(bearer());
        let op = errors(
            op,
            &[
                ("400", "Invalid messages, tools or n (`param` names the field)"),
                ("404", "Unknown model (`model_not_found`)"),
                ("409", "The Idempotency-Key was used with another request (`idempotency_conflict`)"),
                ("413", "Request body too large"),
                ("502", "The run failed (its error code), or the request first sent with this key was interrupted after its tool calls took effect (`request_interrupted`)"),
                ("504", "The run did not finish in time"),
            ],
            "OpenAiError",
        );
        let op = errors(op, v1_errors, "OpenAiError");
        openapi.paths.add_path_operation("/v1/chat/completions", vec![HttpMethod::Post], op.build());

        let op = OperationBuilder::new()
            .operation_id(Some("openai_list_models"))
            .tag("openai")
            .summary(Some("Configured models in OpenAI's list shape"))
            .response("200", response("`{object: list, data}`", "application/json", "OpenAiModelList"))
            .security(bearer());
        openapi.paths.add_path_operation("/v1/models", vec![HttpMethod::Get], errors(op, v1_errors, "OpenAiError").build());

        let op = OperationBuilder::new()
            .operation_id(Some("openai_get_model"))
            .tag("openai")
            .summary(Some("One configured model"))
            .parameter(ParameterBuilder::new().name("id").parameter_in(ParameterIn::Path).required(Required::True).schema(Some(
                utoipa::openapi::schema::ObjectBuilder::new().schema_type(utoipa::openapi::schema::Type::String),
            )))
            .response("200", response("The model", "application/json", "OpenAiModel"))
            .security(bearer());
        let op = errors(op, &[("404", "Unknown model (`model_not_found`)")], "OpenAiError");
        openapi.paths.add_path_operation("/v1/models/{id}", vec![HttpMethod::Get], errors(op, v1_errors, "OpenAiError").build());

        let op = OperationBuilder::new()
            .operation_id(Some("import_thread"))
            .tag("threads")
            .summary(Some("Import a thread: agentloop export, OpenAI messages, or a ServiceStack llms.py thread (`Idempotency-Key`)"))
            .parameter(
                ParameterBuilder::new()
                    .name("Idempotency-Key")
                    .parameter_in(ParameterIn::Header)
                    .required(Required::False)
                    .schema(Some(utoipa::openapi::schema::ObjectBuilder::new().schema_type(utoipa::openapi::schema::Type::String))),
            )
            .request_body(Some(RequestBodyBuilder::new().required(Some(Required::True)).content("application/json", json("ImportDocument")).build()))
            .response("201", response("The new thread", "application/json", "ImportResult"))
            .response("200", response("Replayed: the thread of an identical earlier request with this key", "application/json", "ImportResult"))
            .security(bearer());
        let op = errors(
            op,
            &[
                ("400", "Malformed document (the message names the field)"),
                ("401", "A valid API key is required"),
                ("409", "`idempotency_conflict`"),
                ("413", "Over IMPORT_MAX_BYTES"),
                ("503", "Database unavailable"),
            ],
            "Error",
        );
        openapi.paths.add_path_operation("/api/threads/import", vec![HttpMethod::Post], op.build());

        // MCP streamable HTTP, stateless: POST only (rmcp keeps no session, so GET and DELETE
        // are 405); transport errors in the API's envelope (`mcp_transport_error`).
        let mut op = OperationBuilder::new()
            .operation_id(Some("mcp_post"))
            .tag("mcp")
            .summary(Some("MCP over streamable HTTP (tools: list_threads, create_thread, send_message, get_run, wait_run, approve_tool_call, reject_tool_call, cancel_run; resources: agentloop://threads/{threadId})"))
            .request_body(Some(RequestBodyBuilder::new().required(Some(Required::True)).content("application/json", json("JsonRpcMessage")).build()))
            .response(
                "200",
                ResponseBuilder::new()
                    .description("JSON-RPC answer (application/json or an SSE stream)")
                    .content("application/json", json("JsonRpcMessage"))
                    .content("text/event-stream", Content::new(Some(utoipa::openapi::schema::ObjectBuilder::new().schema_type(utoipa::openapi::schema::Type::String))))
                    .build(),
            )
            .response("202", ResponseBuilder::new().description("Notification accepted").build())
            .security(bearer());
        for (status, description) in [
            ("400", "Malformed JSON-RPC"),
            ("401", "A valid API key is required"),
            ("406", "The Accept header does not allow JSON and SSE"),
            ("413", "Request body too large"),
            ("415", "Not application/json"),
            ("422", "Unprocessable JSON-RPC"),
            ("500", "Internal error"),
        ] {
            op = op.response(status, response(description, "application/json", "Error"));
        }
        openapi.paths.add_path_operation("/mcp", vec![HttpMethod::Post], op.build());
    }
}
