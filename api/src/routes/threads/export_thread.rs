//! `GET /api/threads/{id}/export?format=json|markdown` (CONTRACTS.md "Thread export JSON").

use actix_web::{HttpResponse, web};
use agentloop_shared::messages::{self, Message};
use agentloop_shared::threads::{self, Thread};
use futures_util::StreamExt;
use serde_json::{Map, Value, json};
use uuid::Uuid;

use crate::AppState;
use crate::error::ApiError;
use crate::extract::Authenticated;

/// Most messages read per page while the export streams.
const PAGE: i64 = 200;

/// Most stored bytes (`messages.byte_size`) of one page, unless its first message alone is
/// larger: the api holds about one page (and its encoding) per export, whatever the thread
/// holds (acceptance probe N, N-11: a thread of 150 messages of 2 MB was one 300 MB page).
const PAGE_BYTES: usize = 4 << 20;

/// Query: `format` = `json` (default) or `markdown`.
#[derive(Debug, serde::Deserialize, utoipa::IntoParams)]
#[into_params(parameter_in = Query)]
pub struct ExportQuery {
    /// `json` (default) or `markdown`.
    #[param(pattern = "^(json|markdown)$")]
    pub format: Option<String>,
}

/// One exported message (absent optional fields omitted).
#[derive(Debug, serde::Serialize, utoipa::ToSchema)]
#[serde(rename_all = "camelCase")]
pub struct ExportedMessage {
    /// `system`, `developer`, `user`, `assistant` or `tool`.
    pub role: String,
    /// A string or an array of content parts.
    #[schema(value_type = Value)]
    pub content: Value,
    /// `[{id, type: "function", function: {name, arguments (a JSON string)}}]`.
    #[schema(value_type = Option<Vec<Object>>)]
    pub tool_calls: Option<Value>,
    pub tool_call_id: Option<String>,
    pub reasoning: Option<String>,
    /// The answer was stopped by the user mid-stream (present only when true).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub stopped: bool,
    /// The provider ended the answer early (`length`, `content_filter`, ...; present only then).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub finish_reason: Option<String>,
    #[schema(value_type = String, format = DateTime)]
    pub created_at: chrono::DateTime<chrono::Utc>,
}

/// The exported thread.
#[derive(Debug, serde::Serialize, utoipa::ToSchema)]
#[serde(rename_all = "camelCase")]
pub struct ExportedThread {
    pub id: Uuid,
    pub title: String,
    pub model: Option<String>,
    #[schema(value_type = Object)]
    pub metadata: Value,
    #[schema(value_type = String, format = DateTime)]
    pub created_at: chrono::DateTime<chrono::Utc>,
}

/// The export document: `format` is always `agentloop.thread.v1`.
#[derive(Debug, serde::Serialize, utoipa::ToSchema)]
pub struct ThreadExport {
    pub format: String,
    pub thread: ExportedThread,
    pub messages: Vec<ExportedMessage>,
}

/// The thread's active branch in `sequence` order, as an attachment: JSON (the
/// `agentloop.thread.v1` document CONTRACTS.md fixes, which `POST /api/threads/import` accepts)
/// or a Markdown transcript (`text/markdown`). Streamed in pages of at most 200 messages and
/// 4 MiB of stored text (or one larger message), so a long thread costs the api one page of memory. 200; 400 `invalid_format`; 404.
#[utoipa::path(
    get, path = "/api/threads/{id}/export", tag = "threads", operation_id = "export_thread",
    params(("id" = Uuid, Path, description = "Thread id"), ExportQuery),
    responses((status = 200, description = "The active branch as an attachment: JSON (agentloop.thread.v1) or Markdown",
               content((ThreadExport = "application/json"), (String = "text/markdown"))),
              (status = 400, description = "`invalid_format`", body = crate::views::ErrorBody),
              (status = 404, description = "Not the caller's thread", body = crate::views::ErrorBody))
)]
pub async fn export_thread(
    state: web::Data<AppState>,
    who: Authenticated,
    path: web::Path<Uuid>,
    query: web::Query<ExportQuery>,
) -> Result<HttpResponse, ApiError> {
    let markdown = match query.format.as_deref().unwrap_or("json") {
        "json" => false,
        "markdown" | "md" => true,
        other => return Err(ApiError::bad_request("invalid_format", format!("format must be json or markdown, not '{other}'"))),
    };
    let thread = {
        let mut conn = state.pool.get().await?;
        threads::get_owned(&mut conn, path.into_inner(), who.0.id).await?.ok_or(ApiError::NotFound)?
    };
    let extension = if markdown { "md" } else { "json" };
    let filename = format!("{}.{extension}", slug(&thread.title, thread.id));
    // RFC 6266: `filename` for old clients (ASCII), `filename*` (RFC 8187, UTF-8) keeps the
    // title's letters in every other script.
    let unicode = format!("{}.{extension}", unicode_slug(&thread.title).unwrap_or_else(|| slug(&thread.title, thread.id)));
    let disposition = actix_web::http::header::ContentDisposition {
        disposition: actix_web::http::header::DispositionType::Attachment,
        parameters: vec![
            actix_web::http::header::DispositionParam::Filename(filename),
            actix_web::http::header::DispositionParam::FilenameExt(actix_web::http::header::ExtendedValue {
                charset: actix_web::http::header::Charset::Ext("UTF-8".into()),
                language_tag: None,
                value: unicode.into_bytes(),
            }),
        ],
    };
    let head = if markdown { markdown_head(&thread) } else { json_head(&thread) };
    let tail = if markdown { String::new() } else { "]}\n".to_owned() };

    // A heavy read: held while the body streams (`Limits::heavy_read`).
    let turn = state.limits.heavy_read(who.0.id).await?;
    // Pages of active messages after a sequence cursor; each page is one short read.
    let pool = state.pool.clone();
    let thread_id = thread.id;
    let pages = futures_util::stream::unfold(Some(0i64), move |cursor| {
        let pool = pool.clone();
        async move {
            let after = cursor?;
            let page: Result<Vec<Message>, ApiError> = async {
                let mut conn = pool.get().await?;
                // The next messages up to PAGE_BYTES of stored size (at least one): a page's
                // memory follows this bound, not how large the thread's messages are.
                let metas = messages::active_meta_between(&mut conn, thread_id, Some(after), None, false, PAGE).await?;
                let Some(first) = metas.first().map(|m| m.sequence) else { return Ok(Vec::new()) };
                let mut last = first;
                let mut used = 0usize;
                for meta in &metas {
                    let size = meta.byte_size.max(0) as usize;
                    if meta.sequence != first && used + size > PAGE_BYTES {
                        break;
                    }
                    used += size;
                    last = meta.sequence;
                }
                Ok(messages::active_in_range(&mut conn, thread_id, first, last).await?)
            }
            .await;
            match page {
                Ok(rows) if rows.is_empty() => None,
                Ok(rows) => {
                    let next = rows.last().map(|r| r.sequence);
                    Some((Ok(rows), next))
                }
                Err(e) => Some((Err(e), None)),
            }
        }
    });
    let mut first = true;
    let body = pages.map(move |page| {
        let _turn = &turn;
        page.map(|rows| {
            let mut out = String::new();
            for row in &rows {
                if markdown {
                    out.push_str(&markdown_message(row));
                } else {
                    if !first {
                        out.push(',');
                    }
                    first = false;
                    out.push_str(&exported(row).to_string());
                }
            }
            web::Bytes::from(out)
        })
        .map_err(actix_web::Error::from)
    });
    let stream = futures_util::stream::once(async move { Ok::<_, actix_web::Error>(web::Bytes::from(head)) })
        .chain(body)
        .chain(futures_util::stream::once(async move { Ok(web::Bytes::from(tail)) }));
    Ok(HttpResponse::Ok()
        .content_type(if markdown { "text/markdown; charset=utf-8" } else { "application/json" })
        .insert_header(disposition)
        .streaming(stream))
}

/// A file name from the title: lowercase ASCII letters and digits joined by `-`, at most 60
/// characters; `thread-<id>` for an untitled thread.
pub fn slug(title: &str, id: Uuid) -> String {
    slug_keeping(title, |c| c.is_ascii_alphanumeric()).unwrap_or_else(|| format!("thread-{id}"))
}

/// [`slug`] keeping letters and digits of every script; `None` when the title has none.
pub fn unicode_slug(title: &str) -> Option<String> {
    slug_keeping(title, char::is_alphanumeric)
}

/// The lowercased characters of `title` that `keep` accepts, runs of others as one `-`, at most
/// 60 characters, no `-` at either end; `None` when nothing is left.
fn slug_keeping(title: &str, keep: impl Fn(char) -> bool) -> Option<String> {
    let mut out = String::new();
    let mut n = 0;
    for c in title.chars().flat_map(char::to_lowercase) {
        if keep(c) {
            out.push(c);
            n += 1;
        } else if !out.ends_with('-') && !out.is_empty() {
            out.push('-');
            n += 1;
        }
        if n >= 60 {
            break;
        }
    }
    let out = out.trim_matches('-');
    (!out.is_empty()).then(|| out.to_owned())
}

fn json_head(thread: &Thread) -> String {
    let head = json!({
        "format": "agentloop.thread.v1",
        "thread": {"id": thread.id, "title": thread.title, "model": thread.model, "metadata": thread.metadata,
                   "createdAt": millis(thread.created_at)},
    });
    let text = head.to_string();
    // `{...}` -> `{..., "messages":[` (the messages follow page by page).
    format!("{},\"messages\":[", &text[..text.len() - 1])
}

/// RFC 3339 in UTC with milliseconds (`2026-11-01T10:00:00.000Z`): the import keeps times to
/// the millisecond, so an export of an import reads as its source.
fn millis(at: chrono::DateTime<chrono::Utc>) -> String {
    at.to_rfc3339_opts(chrono::SecondsFormat::Millis, true)
}

/// A message in the export shape: tool calls reduced to `{id, type, function: {name, arguments}}`.
pub fn exported(row: &Message) -> Value {
    let mut out = Map::new();
    out.insert("role".into(), json!(row.role));
    out.insert("content".into(), row.content.clone());
    if let Some(Value::Array(calls)) = &row.tool_calls {
        let calls: Vec<Value> = calls
            .iter()
            .map(|c| {
                let arguments = match &c["function"]["arguments"] {
                    Value::String(s) => s.clone(),
                    Value::Null => "{}".to_owned(),
                    other => other.to_string(),
                };
                json!({"id": c["id"], "type": "function", "function": {"name": c["function"]["name"], "arguments": arguments}})
            })
            .collect();
        out.insert("toolCalls".into(), Value::Array(calls));
    }
    if let Some(id) = &row.tool_call_id {
        out.insert("toolCallId".into(), json!(id));
    }
    if let Some(reasoning) = &row.reasoning {
        out.insert("reasoning".into(), json!(reasoning));
    }
    if row.stopped {
        out.insert("stopped".into(), json!(true));
    }
    if let Some(reason) = &row.finish_reason {
        out.insert("finishReason".into(), json!(reason));
    }
    out.insert("createdAt".into(), json!(millis(row.created_at)));
    Value::Object(out)
}

fn markdown_head(thread: &Thread) -> String {
    let title = if thread.title.is_empty() { "Untitled thread" } else { &thread.title };
    format!(
        "# {}\n\n_Exported from agentloop · thread `{}` · model {} · created {}_\n\n",
        title.replace('\n', " "),
        thread.id,
        thread.model.as_deref().unwrap_or("default"),
        thread.created_at.to_rfc3339()
    )
}

/// A fence longer than any backtick run in `text`.
fn fence(text: &str) -> String {
    let mut longest = 0;
    let mut run = 0;
    for c in text.chars() {
        run = if c == '`' { run + 1 } else { 0 };
        longest = longest.max(run);
    }
    "`".repeat((longest + 1).max(3))
}

fn markdown_message(row: &Message) -> String {
    let text = row.text();
    let when = row.created_at.format("%Y-%m-%d %H:%M UTC");
    let mut out = String::new();
    match row.role.as_str() {
        "tool" => {
            let f = fence(&text);
            out.push_str(&format!("**Tool result** `{}` · {when}\n\n{f}\n{text}\n{f}\n\n", row.tool_call_id.as_deref().unwrap_or("")));
        }
        role => {
            let name = match role {
                "user" => "User",
                "assistant" => "Assistant",
                "system" => "System",
                _ => "Developer",
            };
            out.push_str(&format!("## {name} · {when}\n\n"));
            if let Some(r) = row.reasoning.as_deref().filter(|r| !r.is_empty()) {
                out.push_str(&format!("> _Reasoning:_ {}\n\n", r.replace('\n', "\n> ")));
            }
            if !text.is_empty() {
                out.push_str(&text);
                out.push_str("\n\n");
            }
            if row.stopped {
                out.push_str("_(stopped by the user)_\n\n");
            }
            if let Some(reason) = &row.finish_reason {
                out.push_str(&format!("_(cut off: finish_reason {reason})_\n\n"));
            }
            if let Some(Value::Array(calls)) = &row.tool_calls {
                for c in calls {
                    let args = c["function"]["arguments"].as_str().map(str::to_owned).unwrap_or_else(|| c["function"]["arguments"].to_string());
                    let pretty = serde_json::from_str::<Value>(&args).ok().and_then(|v| serde_json::to_string_pretty(&v).ok()).unwrap_or(args);
                    let f = fence(&pretty);
                    out.push_str(&format!(
                        "**Tool call** `{}` (`{}`)\n\n{f}json\n{pretty}\n{f}\n\n",
                        c["function"]["name"].as_str().unwrap_or("tool"),
                        c["id"].as_str().unwrap_or("")
                    ));
                }
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn slugs_and_fences() {
        let id = Uuid::nil();
        assert_eq!(slug("Trip to Paris: day 1!", id), "trip-to-paris-day-1");
        assert_eq!(slug("   ", id), format!("thread-{id}"));
        assert_eq!(unicode_slug("😀 Ünïcödé — Привет, 世界!").as_deref(), Some("ünïcödé-привет-世界"));
        assert_eq!(unicode_slug("😀 !"), None);
        assert_eq!(fence("a ``` b"), "````");
        assert_eq!(fence("plain"), "```");
    }
}
