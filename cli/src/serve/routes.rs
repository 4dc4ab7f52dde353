//! The routes: `POST /v1/completions`, `POST /v1/chat/completions` (OpenAI's request and response
//! shapes, streamed as server-sent events when asked), `GET /v1/models`, `GET /health`,
//! `GET /metrics`. Every field is read by hand from the JSON so that a bad one is a 400 naming it;
//! fields this server does not know are ignored, and the ones it cannot honour (`n` > 1,
//! `logprobs`, `echo`, penalties) are refused rather than ignored.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::Sender;
use std::time::{SystemTime, UNIX_EPOCH};

use axum::Router;
use axum::body::Body;
use axum::extract::State;
use axum::http::{HeaderValue, StatusCode, header};
use axum::response::sse::{Event as SseEvent, Sse};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use serde_json::{Map, Value, json};
use tessera_models::chat::{ChatMessage, ChatTemplate};
use tessera_models::engine::Finish;
use tessera_models::sample::SamplerParams;
use tessera_models::tokenizer::{EncodeOptions, Tokenizer};
use tokio::sync::mpsc::{UnboundedReceiver, unbounded_channel};

use super::engine::{Cmd, ReqId, SeqEvent};
use super::metrics::Metrics;
use crate::text::TextStream;

/// What every handler shares.
pub struct App {
    pub tok: Tokenizer,
    /// The file's chat template, or why it has none.
    pub template: Result<ChatTemplate, String>,
    pub commands: Sender<Cmd>,
    /// The name `/v1/models` lists and responses carry (the file's stem).
    pub model_id: String,
    /// Most tokens a sequence holds (`--ctx`).
    pub ctx: usize,
    /// Largest request body in bytes (`--max-body`).
    pub max_body: usize,
    pub metrics: Arc<Metrics>,
    pub next_id: AtomicU64,
    pub started: SystemTime,
}

type Shared = Arc<App>;

pub fn router(app: Shared) -> Router {
    Router::new()
        .route("/v1/completions", post(completions))
        .route("/v1/chat/completions", post(chat_completions))
        .route("/v1/models", get(models))
        .route("/health", get(health))
        .route("/metrics", get(metrics))
        .fallback(not_found)
        .with_state(app)
}

/// An error answer: OpenAI's `{"error": {message, type, param, code}}` with a status.
#[derive(Debug)]
struct ApiError {
    status: StatusCode,
    message: String,
    /// The request field at fault.
    param: Option<&'static str>,
}

impl ApiError {
    fn bad(param: &'static str, message: impl Into<String>) -> ApiError {
        ApiError { status: StatusCode::BAD_REQUEST, message: message.into(), param: Some(param) }
    }

    fn status(status: StatusCode, message: impl Into<String>) -> ApiError {
        ApiError { status, message: message.into(), param: None }
    }

    fn body(&self) -> Value {
        let kind = match self.status.as_u16() {
            400..=499 => "invalid_request_error",
            503 => "server_busy",
            _ => "server_error",
        };
        json!({"error": {"message": self.message, "type": kind, "param": self.param, "code": null}})
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let mut r = (self.status, axum::Json(self.body())).into_response();
        if self.status == StatusCode::SERVICE_UNAVAILABLE {
            r.headers_mut().insert(header::RETRY_AFTER, HeaderValue::from_static("1"));
        }
        r
    }
}

/// Counts the answer in the metrics under `route`.
fn counted(app: &App, route: &'static str, r: Result<Response, ApiError>) -> Response {
    let r = r.unwrap_or_else(IntoResponse::into_response);
    app.metrics.request(route, r.status().as_u16());
    r
}

async fn not_found(State(app): State<Shared>) -> Response {
    counted(&app, "other", Err(ApiError::status(StatusCode::NOT_FOUND, "no such route")))
}

async fn health(State(app): State<Shared>) -> Response {
    let (running, waiting, kv_blocks) = app.metrics.load();
    let body = json!({"status": "ok", "running": running, "waiting": waiting, "kv_blocks_used": kv_blocks});
    counted(&app, "/health", Ok(axum::Json(body).into_response()))
}

async fn models(State(app): State<Shared>) -> Response {
    let body = json!({"object": "list", "data": [{
        "id": app.model_id, "object": "model", "created": unix(app.started), "owned_by": "tessera",
        "max_model_len": app.ctx,
    }]});
    counted(&app, "/v1/models", Ok(axum::Json(body).into_response()))
}

async fn metrics(State(app): State<Shared>) -> Response {
    app.metrics.request("/metrics", 200);
    ([(header::CONTENT_TYPE, "text/plain; version=0.0.4")], app.metrics.render()).into_response()
}

/// Which route a generation request came through.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Kind {
    Completion,
    Chat,
}

impl Kind {
    fn route(self) -> &'static str {
        match self {
            Kind::Completion => "/v1/completions",
            Kind::Chat => "/v1/chat/completions",
        }
    }
}

async fn completions(State(app): State<Shared>, body: Body) -> Response {
    let r = generate(app.clone(), Kind::Completion, body).await;
    counted(&app, Kind::Completion.route(), r)
}

async fn chat_completions(State(app): State<Shared>, body: Body) -> Response {
    let r = generate(app.clone(), Kind::Chat, body).await;
    counted(&app, Kind::Chat.route(), r)
}

/// A checked generation request.
struct Request {
    prompt: Vec<u32>,
    max_new: usize,
    params: SamplerParams,
    stops: Vec<String>,
    stream: bool,
    include_usage: bool,
}

/// Most `stop` strings a request may give (OpenAI's limit).
const MAX_STOPS: usize = 4;
/// Longest `stop` string, in bytes.
const MAX_STOP_BYTES: usize = 256;

async fn generate(app: Shared, kind: Kind, body: Body) -> Result<Response, ApiError> {
    let bytes = axum::body::to_bytes(body, app.max_body).await.map_err(|_| {
        ApiError::status(
            StatusCode::PAYLOAD_TOO_LARGE,
            format!("the request body is larger than {} bytes (--max-body), or could not be read", app.max_body),
        )
    })?;
    // Parsing, rendering and encoding take time on long prompts: off the async workers.
    let parse_app = app.clone();
    let req = tokio::task::spawn_blocking(move || parse(&parse_app, kind, &bytes)).await.map_err(|_| {
        ApiError::status(StatusCode::INTERNAL_SERVER_ERROR, "internal error while reading the request")
    })??;
    let id = app.next_id.fetch_add(1, Ordering::Relaxed);
    let (tx, mut rx) = unbounded_channel();
    let submit = Cmd::Submit { id, prompt: req.prompt.clone(), max_new: req.max_new, params: req.params, events: tx };
    app.commands
        .send(submit)
        .map_err(|_| ApiError::status(StatusCode::SERVICE_UNAVAILABLE, "the engine has stopped"))?;
    // From here on, dropping the guard (a client that went away) cancels the sequence.
    let guard = CancelOnDrop { id, commands: app.commands.clone() };
    match rx.recv().await {
        Some(SeqEvent::Accepted) => {}
        Some(SeqEvent::Busy { running, waiting }) => {
            return Err(ApiError::status(
                StatusCode::SERVICE_UNAVAILABLE,
                format!(
                    "the server is busy: {running} sequences running and {waiting} waiting fill its queue (--max-seqs, --queue); retry later"
                ),
            ));
        }
        Some(SeqEvent::Invalid(why)) => return Err(ApiError::bad(kind.prompt_field(), why)),
        Some(other) => {
            return Err(ApiError::status(
                StatusCode::INTERNAL_SERVER_ERROR,
                format!("unexpected engine answer {other:?}"),
            ));
        }
        None => return Err(ApiError::status(StatusCode::SERVICE_UNAVAILABLE, "the engine has stopped")),
    }
    let meta = Meta { id: format!("{}-{id}", kind.id_prefix()), created: unix(SystemTime::now()), kind };
    if req.stream {
        return Ok(stream(app, meta, req, rx, guard));
    }
    let mut out = Collected::default();
    let finish = {
        let mut text = TextStream::new(&app.tok, &req.stops);
        let finish = follow(&mut rx, &mut text, &mut out, |_| true).await?;
        out.text.push_str(&text.finish());
        finish
    };
    drop(guard);
    Ok(axum::Json(meta.whole(&app, &out.text, finish, usage(req.prompt.len(), out.tokens))).into_response())
}

/// What a request generated so far.
#[derive(Default)]
struct Collected {
    text: String,
    tokens: usize,
}

/// Reads the request's events until it finishes, adding text to `out`; `on_text` gets each new
/// piece and returns false when its reader is gone. Returns the finish reason.
async fn follow(
    rx: &mut UnboundedReceiver<SeqEvent>,
    text: &mut TextStream<'_>,
    out: &mut Collected,
    mut on_text: impl FnMut(&str) -> bool,
) -> Result<&'static str, ApiError> {
    loop {
        match rx.recv().await {
            Some(SeqEvent::Token(t)) => {
                out.tokens += 1;
                let piece = text.push(t).map_err(|e| ApiError::status(StatusCode::INTERNAL_SERVER_ERROR, e))?;
                out.text.push_str(&piece);
                if !piece.is_empty() && !on_text(&piece) {
                    return Ok("cancelled");
                }
                if text.stopped() {
                    // The caller's guard cancels the rest of the sequence.
                    return Ok("stop");
                }
            }
            Some(SeqEvent::Finished(Finish::Length)) => return Ok("length"),
            Some(SeqEvent::Finished(Finish::Stop)) => return Ok("stop"),
            Some(SeqEvent::Failed(why)) => return Err(ApiError::status(StatusCode::INTERNAL_SERVER_ERROR, why)),
            Some(other) => {
                return Err(ApiError::status(
                    StatusCode::INTERNAL_SERVER_ERROR,
                    format!("unexpected engine event {other:?}"),
                ));
            }
            None => return Err(ApiError::status(StatusCode::INTERNAL_SERVER_ERROR, "the engine dropped the request")),
        }
    }
}

/// The SSE answer: a task follows the sequence and sends each piece as a chunk; when the client
/// goes away the body (and with it the chunk receiver) is dropped, the task sees that, returns,
/// and its guard cancels the sequence.
fn stream(app: Shared, meta: Meta, req: Request, mut rx: UnboundedReceiver<SeqEvent>, guard: CancelOnDrop) -> Response {
    let (chunks, chunk_rx) = unbounded_channel::<String>();
    tokio::spawn(async move {
        let _guard = guard;
        let mut out = Collected::default();
        if meta.kind == Kind::Chat {
            let _ = chunks.send(meta.chunk(&app, json!({"role": "assistant", "content": ""}), None).to_string());
        }
        let mut text = TextStream::new(&app.tok, &req.stops);
        let send_piece = |piece: &str| chunks.send(meta.piece(&app, piece).to_string()).is_ok();
        let result = tokio::select! {
            r = follow(&mut rx, &mut text, &mut out, send_piece) => r,
            _ = chunks.closed() => return,
        };
        match result {
            Ok("cancelled") => {}
            Ok(finish) => {
                let rest = text.finish();
                if !rest.is_empty() {
                    let _ = chunks.send(meta.piece(&app, &rest).to_string());
                }
                let _ = chunks.send(meta.end(&app, finish).to_string());
                if req.include_usage {
                    let mut u = meta.chunk(&app, Value::Null, None);
                    u["choices"] = json!([]);
                    u["usage"] = usage(req.prompt.len(), out.tokens);
                    let _ = chunks.send(u.to_string());
                }
            }
            Err(e) => {
                let _ = chunks.send(e.body().to_string());
            }
        }
        let _ = chunks.send("[DONE]".to_string());
    });
    let events = futures_util::stream::unfold(chunk_rx, |mut rx| async move {
        rx.recv().await.map(|data| (Ok::<_, std::convert::Infallible>(SseEvent::default().data(data)), rx))
    });
    Sse::new(events).into_response()
}

/// Sends [`Cmd::Cancel`] for its request when dropped: at the end of a request, and when the
/// handler or streaming task is dropped because the client went away. Cancelling a finished
/// request is a no-op in the engine thread.
struct CancelOnDrop {
    id: ReqId,
    commands: Sender<Cmd>,
}

impl Drop for CancelOnDrop {
    fn drop(&mut self) {
        let _ = self.commands.send(Cmd::Cancel(self.id));
    }
}

/// The identity every response or chunk of one request carries.
struct Meta {
    id: String,
    created: u64,
    kind: Kind,
}

impl Meta {
    /// The non-streamed answer.
    fn whole(&self, app: &App, text: &str, finish: &str, usage: Value) -> Value {
        let choice = match self.kind {
            Kind::Completion => json!({"index": 0, "text": text, "logprobs": null, "finish_reason": finish}),
            Kind::Chat => json!({
                "index": 0, "message": {"role": "assistant", "content": text}, "logprobs": null,
                "finish_reason": finish,
            }),
        };
        let object = match self.kind {
            Kind::Completion => "text_completion",
            Kind::Chat => "chat.completion",
        };
        json!({"id": self.id, "object": object, "created": self.created, "model": app.model_id,
               "choices": [choice], "usage": usage})
    }

    /// One streamed chunk: `delta` is the chat delta (ignored for completions, whose text is in
    /// `text`).
    fn chunk(&self, app: &App, delta: Value, finish: Option<&str>) -> Value {
        let (object, choice) = match self.kind {
            Kind::Completion => (
                "text_completion",
                json!({"index": 0, "text": delta.get("content").cloned().unwrap_or(json!("")),
                       "logprobs": null, "finish_reason": finish}),
            ),
            Kind::Chat => (
                "chat.completion.chunk",
                json!({"index": 0, "delta": delta, "logprobs": null, "finish_reason": finish}),
            ),
        };
        json!({"id": self.id, "object": object, "created": self.created, "model": app.model_id, "choices": [choice]})
    }

    fn piece(&self, app: &App, text: &str) -> Value {
        self.chunk(app, json!({"content": text}), None)
    }

    fn end(&self, app: &App, finish: &str) -> Value {
        self.chunk(app, json!({}), Some(finish))
    }
}

impl Kind {
    fn id_prefix(self) -> &'static str {
        match self {
            Kind::Completion => "cmpl",
            Kind::Chat => "chatcmpl",
        }
    }

    fn prompt_field(self) -> &'static str {
        match self {
            Kind::Completion => "prompt",
            Kind::Chat => "messages",
        }
    }
}

fn usage(prompt: usize, completion: usize) -> Value {
    json!({"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion})
}

fn unix(t: SystemTime) -> u64 {
    t.duration_since(UNIX_EPOCH).map(|d| d.as_secs()).unwrap_or(0)
}

/// Reads and checks a request body; encodes its prompt.
fn parse(app: &App, kind: Kind, bytes: &[u8]) -> Result<Request, ApiError> {
    let value: Value = serde_json::from_slice(bytes)
        .map_err(|e| ApiError::status(StatusCode::BAD_REQUEST, format!("the body is not valid JSON: {e}")))?;
    let Value::Object(o) = value else {
        return Err(ApiError::status(StatusCode::BAD_REQUEST, "the body must be a JSON object"));
    };
    let prompt = match kind {
        Kind::Completion => completion_prompt(app, &o)?,
        Kind::Chat => chat_prompt(app, &o)?,
    };
    let field = kind.prompt_field();
    if prompt.is_empty() {
        return Err(ApiError::bad(field, format!("`{field}` encodes to no tokens")));
    }
    if let Some(&t) = prompt.iter().find(|&&t| t as usize >= app.tok.n_vocab()) {
        return Err(ApiError::bad(field, format!("token id {t} is outside the vocabulary of {}", app.tok.n_vocab())));
    }
    if prompt.len() >= app.ctx {
        return Err(ApiError::bad(
            field,
            format!(
                "`{field}` is {} tokens: no room to generate within the context of {} tokens",
                prompt.len(),
                app.ctx
            ),
        ));
    }
    // The last generated token is never fed: prompt + max_tokens - 1 positions.
    let room = app.ctx - prompt.len() + 1;
    let max_field = if kind == Kind::Chat && o.contains_key("max_completion_tokens") {
        "max_completion_tokens"
    } else {
        "max_tokens"
    };
    let max_new = match uint(&o, max_field)? {
        None => room,
        Some(0) => return Err(ApiError::bad(max_field, format!("`{max_field}` must be at least 1"))),
        Some(n) if n > room as u64 => {
            return Err(ApiError::bad(
                max_field,
                format!(
                    "`{max_field}` {n} with a prompt of {} tokens exceeds the context of {} tokens (at most {room})",
                    prompt.len(),
                    app.ctx
                ),
            ));
        }
        Some(n) => n as usize,
    };
    let temperature = number(&o, "temperature")?.unwrap_or(1.0);
    if !(0.0..=100.0).contains(&temperature) {
        return Err(ApiError::bad("temperature", format!("`temperature` must be in [0, 100], not {temperature}")));
    }
    let top_p = number(&o, "top_p")?.unwrap_or(1.0);
    if !(top_p > 0.0 && top_p <= 1.0) {
        return Err(ApiError::bad("top_p", format!("`top_p` must be in (0, 1], not {top_p}")));
    }
    // 0 and -1 switch top-k off, as llama.cpp and vLLM take them.
    let top_k = match o.get("top_k") {
        None | Some(Value::Null) => None,
        Some(v) => match v.as_i64() {
            Some(0 | -1) => None,
            Some(k) if k > 0 => Some(k as usize),
            _ => return Err(ApiError::bad("top_k", "`top_k` must be a positive integer (0 or -1: off)")),
        },
    };
    let seed = match uint(&o, "seed")? {
        Some(s) => s,
        // No seed: a different draw per request.
        None => SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_nanos() as u64).unwrap_or(0),
    };
    let params = SamplerParams { temperature: temperature as f32, top_k, top_p: top_p as f32, seed };
    params.validate().map_err(|e| ApiError::bad("temperature", e.to_string()))?;
    let stops = stops(&o)?;
    let stream = boolean(&o, "stream")?.unwrap_or(false);
    let include_usage = match o.get("stream_options") {
        None | Some(Value::Null) => false,
        Some(Value::Object(so)) => boolean(so, "include_usage")?.unwrap_or(false),
        Some(_) => return Err(ApiError::bad("stream_options", "`stream_options` must be an object")),
    };
    refuse_unsupported(&o)?;
    Ok(Request { prompt, max_new, params, stops, stream, include_usage })
}

/// `prompt`: a string, a one-string array, or an array of token ids.
fn completion_prompt(app: &App, o: &Map<String, Value>) -> Result<Vec<u32>, ApiError> {
    let text = match o.get("prompt") {
        None | Some(Value::Null) => return Err(ApiError::bad("prompt", "`prompt` is missing")),
        Some(Value::String(s)) => s.as_str(),
        Some(Value::Array(a)) => match a.as_slice() {
            [Value::String(s)] => s.as_str(),
            a if !a.is_empty() && a.iter().all(Value::is_number) => {
                return a
                    .iter()
                    .map(|v| v.as_u64().and_then(|t| u32::try_from(t).ok()))
                    .collect::<Option<Vec<u32>>>()
                    .ok_or_else(|| ApiError::bad("prompt", "`prompt` token ids must be integers in the vocabulary"));
            }
            _ => {
                return Err(ApiError::bad(
                    "prompt",
                    "`prompt` must be a string, one string in an array, or an array of token ids (one prompt per request)",
                ));
            }
        },
        Some(_) => return Err(ApiError::bad("prompt", "`prompt` must be a string or an array")),
    };
    // Plain text: control-token texts in it stay text.
    Ok(app.tok.encode_with(text, EncodeOptions { parse_special: false, add_bos: app.tok.add_bos() }))
}

/// `messages` rendered through the file's chat template, the assistant's turn opened.
fn chat_prompt(app: &App, o: &Map<String, Value>) -> Result<Vec<u32>, ApiError> {
    let template = app.template.as_ref().map_err(|why| {
        ApiError::bad("messages", format!("this model has no usable chat template ({why}): use /v1/completions"))
    })?;
    let Some(Value::Array(list)) = o.get("messages") else {
        return Err(ApiError::bad("messages", "`messages` must be an array of {role, content} objects"));
    };
    if list.is_empty() {
        return Err(ApiError::bad("messages", "`messages` is empty"));
    }
    let mut messages = Vec::with_capacity(list.len());
    for (i, m) in list.iter().enumerate() {
        let bad = |why: &str| ApiError::bad("messages", format!("messages[{i}]: {why}"));
        let role = m.get("role").and_then(Value::as_str).ok_or_else(|| bad("`role` must be a string"))?;
        if !matches!(role, "system" | "user" | "assistant" | "developer" | "tool") {
            return Err(bad("`role` must be system, developer, user, assistant or tool"));
        }
        let content = match m.get("content") {
            None | Some(Value::Null) => String::new(),
            Some(Value::String(s)) => s.clone(),
            // Content parts: only text ones.
            Some(Value::Array(parts)) => {
                let mut s = String::new();
                for p in parts {
                    match (p.get("type").and_then(Value::as_str), p.get("text").and_then(Value::as_str)) {
                        (Some("text"), Some(t)) => s.push_str(t),
                        _ => {
                            return Err(bad(
                                "only text content parts ({\"type\": \"text\", \"text\": ...}) are supported",
                            ));
                        }
                    }
                }
                s
            }
            Some(_) => return Err(bad("`content` must be a string or an array of text parts")),
        };
        messages.push(ChatMessage::new(if role == "developer" { "system" } else { role }, content));
    }
    let rendered = template.render(&messages, true).map_err(|e| ApiError::bad("messages", e.to_string()))?;
    // The template writes control tokens: parse them.
    Ok(app.tok.encode_with(&rendered, EncodeOptions { parse_special: true, add_bos: app.tok.add_bos() }))
}

fn stops(o: &Map<String, Value>) -> Result<Vec<String>, ApiError> {
    let list = match o.get("stop") {
        None | Some(Value::Null) => return Ok(Vec::new()),
        Some(Value::String(s)) => vec![s.clone()],
        Some(Value::Array(a)) => a
            .iter()
            .map(|v| v.as_str().map(str::to_string))
            .collect::<Option<Vec<String>>>()
            .ok_or_else(|| ApiError::bad("stop", "`stop` must be a string or an array of strings"))?,
        Some(_) => return Err(ApiError::bad("stop", "`stop` must be a string or an array of strings")),
    };
    if list.len() > MAX_STOPS {
        return Err(ApiError::bad("stop", format!("`stop` has {} strings; at most {MAX_STOPS}", list.len())));
    }
    if list.iter().any(|s| s.is_empty() || s.len() > MAX_STOP_BYTES) {
        return Err(ApiError::bad("stop", format!("each `stop` string must have 1 to {MAX_STOP_BYTES} bytes")));
    }
    Ok(list)
}

/// Fields whose meaning this server cannot give: refused, so a client never gets silently less.
fn refuse_unsupported(o: &Map<String, Value>) -> Result<(), ApiError> {
    if let Some(n) = uint(o, "n")?
        && n != 1
    {
        return Err(ApiError::bad("n", "`n` must be 1: one choice per request"));
    }
    if let Some(n) = uint(o, "best_of")?
        && n != 1
    {
        return Err(ApiError::bad("best_of", "`best_of` must be 1"));
    }
    for f in ["echo", "logprobs"] {
        let on = match o.get(f) {
            None | Some(Value::Null) | Some(Value::Bool(false)) => false,
            Some(Value::Number(n)) => n.as_u64() != Some(0),
            Some(_) => true,
        };
        if on {
            return Err(ApiError::bad(
                if f == "echo" { "echo" } else { "logprobs" },
                format!("`{f}` is not supported"),
            ));
        }
    }
    for f in ["presence_penalty", "frequency_penalty"] {
        if number(o, f)?.is_some_and(|p| p != 0.0) {
            let param = if f == "presence_penalty" { "presence_penalty" } else { "frequency_penalty" };
            return Err(ApiError::bad(param, format!("`{f}` is not supported (only 0)")));
        }
    }
    Ok(())
}

/// An optional non-negative integer field.
fn uint(o: &Map<String, Value>, f: &'static str) -> Result<Option<u64>, ApiError> {
    match o.get(f) {
        None | Some(Value::Null) => Ok(None),
        Some(v) => {
            v.as_u64().map(Some).ok_or_else(|| ApiError::bad(f, format!("`{f}` must be a non-negative integer")))
        }
    }
}

/// An optional finite number field.
fn number(o: &Map<String, Value>, f: &'static str) -> Result<Option<f64>, ApiError> {
    match o.get(f) {
        None | Some(Value::Null) => Ok(None),
        Some(v) => v
            .as_f64()
            .filter(|x| x.is_finite())
            .map(Some)
            .ok_or_else(|| ApiError::bad(f, format!("`{f}` must be a number"))),
    }
}

fn boolean(o: &Map<String, Value>, f: &'static str) -> Result<Option<bool>, ApiError> {
    match o.get(f) {
        None | Some(Value::Null) => Ok(None),
        Some(Value::Bool(b)) => Ok(Some(*b)),
        Some(_) => Err(ApiError::bad(f, format!("`{f}` must be true or false"))),
    }
}
