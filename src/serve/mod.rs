//! `streamrl serve`: an OpenAI-compatible HTTP server over the continuous-batching engine.
//!
//! One engine thread owns the model; HTTP handlers send it requests over a channel and
//! receive per-token events back, so concurrent requests (and the `n` choices of one
//! request) share every decode step. Routes: `POST /v1/completions`,
//! `POST /v1/chat/completions` (both with `n`, `logprobs`, `stop`, `seed`, `usage` and
//! server-sent-event streaming), `POST /v1/load_weights` (an in-flight weight update:
//! `{path, version, sha256}`), `GET /v1/models`, `GET /health`. vLLM's
//! `return_tokens_as_token_ids` (plus per-token `policy_versions`) and
//! `include_stop_str_in_output` extensions are understood. Bad requests get a 4xx
//! with an OpenAI-style `{"error": {"message", "type", "param", "code"}}` body.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{SystemTime, UNIX_EPOCH};

use anyhow::{Context, Result, anyhow};
use axum::Router;
use axum::body::Bytes;
use axum::extract::State;
use axum::http::StatusCode;
use axum::response::sse::{Event as SseEvent, Sse};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use clap::Args;
use serde_json::{Value, json};
use streamrl_model::Tokenizer;
use streamrl_model::chat::{ChatMessage, ChatTemplate};
use streamrl_model::engine::{Engine, EngineConfig, Event, FinishReason, Output, SamplingParams};
use tokio::sync::mpsc;

/// `streamrl serve` arguments.
#[derive(Args, Debug)]
pub struct ServeArgs {
    /// Checkpoint directory (HF layout with tokenizer.json).
    #[arg(long)]
    checkpoint: PathBuf,
    /// Address to listen on.
    #[arg(long, default_value = "127.0.0.1:8000")]
    listen: SocketAddr,
    /// Model name clients use (default: the checkpoint directory's name).
    #[arg(long)]
    served_model_name: Option<String>,
    /// Sequences decoded together at most.
    #[arg(long, default_value_t = 64)]
    max_num_seqs: usize,
}

enum Ev {
    Token(u32),
    Done(Output),
    Error(String),
}

struct Add {
    prompt: Vec<u32>,
    params: SamplingParams,
    index: usize,
    events: mpsc::UnboundedSender<(usize, Ev)>,
}

/// What the engine thread is asked to do.
enum Cmd {
    /// Start a sequence.
    Add(Add),
    /// Load new weights between two steps (an in-flight update: running sequences go on
    /// with the new weights).
    Load {
        dir: PathBuf,
        version: u32,
        sha256: Option<String>,
        reply: tokio::sync::oneshot::Sender<Result<u32, String>>,
    },
}

struct AppState {
    engine: std::sync::mpsc::Sender<Cmd>,
    tokenizer: Tokenizer,
    template: ChatTemplate,
    model: String,
    context: usize,
}

/// The engine loop: admits new requests between steps, routes events, cancels requests
/// whose client went away.
fn engine_loop(mut engine: Engine, rx: std::sync::mpsc::Receiver<Cmd>) {
    let mut routes: HashMap<u64, (usize, mpsc::UnboundedSender<(usize, Ev)>)> = HashMap::new();
    loop {
        let mut incoming = Vec::new();
        if engine.has_work() {
            while let Ok(a) = rx.try_recv() {
                incoming.push(a);
            }
        } else {
            match rx.recv() {
                Ok(a) => incoming.push(a),
                Err(_) => return,
            }
        }
        let mut adds = Vec::new();
        for cmd in incoming {
            match cmd {
                Cmd::Add(a) => adds.push(a),
                Cmd::Load {
                    dir,
                    version,
                    sha256,
                    reply,
                } => {
                    let r = engine
                        .load_weights(&dir, version, sha256.as_deref())
                        .map(|()| engine.version())
                        .map_err(|e| e.to_string());
                    let _ = reply.send(r);
                }
            }
        }
        if !engine.has_work() && adds.is_empty() {
            continue;
        }
        for a in adds {
            match engine.add(a.prompt, a.params) {
                Ok(id) => {
                    routes.insert(id, (a.index, a.events));
                }
                Err(e) => {
                    let _ = a.events.send((a.index, Ev::Error(e.to_string())));
                }
            }
        }
        let events = match engine.step() {
            Ok(e) => e,
            Err(e) => {
                for (_, (i, tx)) in routes.drain() {
                    let _ = tx.send((i, Ev::Error(format!("engine step failed: {e}"))));
                }
                continue;
            }
        };
        let mut gone = Vec::new();
        for e in events {
            match e {
                Event::Token { id, token, .. } => {
                    if let Some((i, tx)) = routes.get(&id)
                        && tx.send((*i, Ev::Token(token))).is_err()
                    {
                        gone.push(id);
                    }
                }
                Event::Done(o) => {
                    if let Some((i, tx)) = routes.remove(&o.id) {
                        let _ = tx.send((i, Ev::Done(o)));
                    }
                }
            }
        }
        for id in gone {
            routes.remove(&id);
            engine.cancel(id);
        }
    }
}

/// Runs the server until SIGINT/SIGTERM.
pub async fn serve(a: ServeArgs) -> Result<()> {
    let loaded = streamrl_model::checkpoint::load(&a.checkpoint, &candle_core::Device::Cpu)
        .with_context(|| format!("loading {}", a.checkpoint.display()))?;
    let tokenizer = loaded
        .tokenizer
        .ok_or_else(|| anyhow!("{} has no tokenizer.json", a.checkpoint.display()))?;
    let template = ChatTemplate::for_checkpoint(&a.checkpoint)?;
    let context = loaded.config.max_positions;
    let engine = Engine::new(
        loaded.model,
        0,
        Some(tokenizer.clone()),
        EngineConfig {
            max_num_seqs: a.max_num_seqs,
            ..Default::default()
        },
    );
    let kernels = engine.kernels();
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::Builder::new()
        .name("engine".into())
        .spawn(move || engine_loop(engine, rx))?;
    let model = a.served_model_name.unwrap_or_else(|| {
        std::fs::canonicalize(&a.checkpoint)
            .ok()
            .and_then(|p| p.file_name().map(|n| n.to_string_lossy().into_owned()))
            .unwrap_or_else(|| "streamrl".into())
    });
    let state = Arc::new(AppState {
        engine: tx,
        tokenizer,
        template,
        model,
        context,
    });
    let app = Router::new()
        .route("/health", get(|| async { axum::Json(json!({"status": "ok"})) }))
        .route("/v1/models", get(models))
        .route("/v1/completions", post(completions))
        .route("/v1/chat/completions", post(chat))
        .route("/v1/load_weights", post(load_weights))
        .fallback(|| async { error(StatusCode::NOT_FOUND, "no such route", None) })
        .with_state(state.clone());
    let listener = tokio::net::TcpListener::bind(a.listen)
        .await
        .with_context(|| format!("listening on {}", a.listen))?;
    eprintln!(
        "serving `{}` from {} on http://{} ({kernels} kernels)",
        state.model,
        a.checkpoint.display(),
        listener.local_addr()?
    );
    let shutdown = streamrl_runtime::runner::Shutdown::new();
    shutdown.on_signals();
    axum::serve(listener, app)
        .with_graceful_shutdown(async move { shutdown.wait().await })
        .await?;
    Ok(())
}

fn error(status: StatusCode, message: impl Into<String>, param: Option<&str>) -> Response {
    let kind = if status == StatusCode::NOT_FOUND {
        "not_found_error"
    } else {
        "invalid_request_error"
    };
    (
        status,
        axum::Json(json!({"error": {"message": message.into(), "type": kind, "param": param, "code": null}})),
    )
        .into_response()
}

struct BadRequest(StatusCode, String, Option<&'static str>);

impl BadRequest {
    fn new(message: impl Into<String>, param: &'static str) -> Self {
        BadRequest(StatusCode::BAD_REQUEST, message.into(), Some(param))
    }
}

async fn models(State(s): State<Arc<AppState>>) -> Response {
    axum::Json(json!({
        "object": "list",
        "data": [{"id": s.model, "object": "model", "created": now(), "owned_by": "streamrl", "max_model_len": s.context}],
    }))
    .into_response()
}

fn now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}

/// What both endpoints share once parsed.
struct Parsed {
    prompt: Vec<u32>,
    params: Vec<SamplingParams>,
    stream: bool,
    logprobs: bool,
    /// vLLM's extension: logprob tokens as `token_id:N`; streamrl adds each token's
    /// policy version (`policy_versions`) to the choice.
    token_ids: bool,
}

fn num(body: &Value, key: &'static str) -> Result<Option<f64>, BadRequest> {
    match body.get(key) {
        None | Some(Value::Null) => Ok(None),
        Some(v) => v
            .as_f64()
            .map(Some)
            .ok_or_else(|| BadRequest::new(format!("`{key}` must be a number, got {v}"), key)),
    }
}

fn parse_common(s: &AppState, body: &Value, prompt: Vec<u32>, default_max: usize) -> Result<Parsed, BadRequest> {
    if let Some(m) = body.get("model").and_then(Value::as_str)
        && m != s.model
    {
        return Err(BadRequest(
            StatusCode::NOT_FOUND,
            format!("The model `{m}` does not exist; this server serves `{}`", s.model),
            Some("model"),
        ));
    }
    let n = num(body, "n")?.unwrap_or(1.0);
    if !(1.0..=128.0).contains(&n) || n.fract() != 0.0 {
        return Err(BadRequest::new(
            format!("`n` must be an integer in 1..=128, got {n}"),
            "n",
        ));
    }
    let temperature = num(body, "temperature")?.unwrap_or(1.0);
    if !(0.0..=2.0).contains(&temperature) {
        return Err(BadRequest::new(
            format!("`temperature` must be in [0, 2], got {temperature}"),
            "temperature",
        ));
    }
    let top_p = num(body, "top_p")?.unwrap_or(1.0);
    let max_tokens = num(body, "max_completion_tokens")?
        .or(num(body, "max_tokens")?)
        .unwrap_or(default_max as f64);
    if max_tokens < 1.0 || max_tokens.fract() != 0.0 {
        return Err(BadRequest::new(
            format!("`max_tokens` must be a positive integer, got {max_tokens}"),
            "max_tokens",
        ));
    }
    if prompt.is_empty() {
        return Err(BadRequest::new("the prompt is empty", "prompt"));
    }
    if prompt.len() + max_tokens as usize > s.context {
        return Err(BadRequest::new(
            format!(
                "This model's maximum context length is {} tokens; the prompt has {} and max_tokens is {max_tokens}",
                s.context,
                prompt.len()
            ),
            "max_tokens",
        ));
    }
    let stop = match body.get("stop") {
        None | Some(Value::Null) => vec![],
        Some(Value::String(x)) => vec![x.clone()],
        Some(Value::Array(a)) if a.iter().all(Value::is_string) => {
            a.iter().filter_map(|x| x.as_str().map(str::to_string)).collect()
        }
        Some(v) => {
            return Err(BadRequest::new(
                format!("`stop` must be a string or a list of strings, got {v}"),
                "stop",
            ));
        }
    };
    // vLLM's extension: keep the stop string in the text (streamrl's tool-call markers).
    let keep_stop = body
        .get("include_stop_str_in_output")
        .and_then(Value::as_bool)
        .unwrap_or(false);
    let (stop, kept_stop) = if keep_stop { (vec![], stop) } else { (stop, vec![]) };
    // Seeds are 64-bit: read them as integers (a JSON double would round them).
    let seed = match body.get("seed").and_then(Value::as_u64) {
        Some(x) => Some(x),
        None => num(body, "seed")?.map(|x| x as u64),
    };
    let top_k = num(body, "top_k")?.map_or(0, |k| k.max(0.0) as usize);
    let params: Vec<SamplingParams> = (0..n as u64)
        .map(|i| SamplingParams {
            temperature: temperature as f32,
            top_p: top_p as f32,
            top_k,
            seed: seed.map_or_else(rand::random, |s| s.wrapping_add(i)),
            max_tokens: max_tokens as usize,
            stop: stop.clone(),
            tool_call_stop: kept_stop.clone(),
            ..Default::default()
        })
        .collect();
    if let Some(p) = params.first().map(SamplingParams::problems).filter(|p| !p.is_empty()) {
        return Err(BadRequest::new(p.join("; "), "temperature"));
    }
    let stream = body.get("stream").and_then(Value::as_bool).unwrap_or(false);
    let logprobs = match body.get("logprobs") {
        None | Some(Value::Null) | Some(Value::Bool(false)) => false,
        Some(Value::Bool(true)) => true,
        Some(v) => v.as_u64().is_some(),
    };
    let token_ids = body
        .get("return_tokens_as_token_ids")
        .and_then(Value::as_bool)
        .unwrap_or(false);
    Ok(Parsed {
        prompt,
        params,
        stream,
        logprobs,
        token_ids,
    })
}

fn parse_body(bytes: &Bytes) -> Result<Value, BadRequest> {
    let v: Value = serde_json::from_slice(bytes).map_err(|e| {
        BadRequest(
            StatusCode::BAD_REQUEST,
            format!("the body is not valid JSON: {e}"),
            None,
        )
    })?;
    if !v.is_object() {
        return Err(BadRequest(
            StatusCode::BAD_REQUEST,
            "the body must be a JSON object".into(),
            None,
        ));
    }
    Ok(v)
}

async fn completions(State(s): State<Arc<AppState>>, body: Bytes) -> Response {
    let r = (|| {
        let body = parse_body(&body)?;
        let prompt = match body.get("prompt") {
            Some(Value::String(p)) => s
                .tokenizer
                .encode(p)
                .map_err(|e| BadRequest::new(e.to_string(), "prompt"))?,
            Some(Value::Array(a)) if !a.is_empty() && a.iter().all(|x| x.as_u64().is_some()) => {
                a.iter().filter_map(|x| x.as_u64().map(|t| t as u32)).collect()
            }
            Some(Value::Array(a)) if a.len() == 1 && a[0].is_string() => s
                .tokenizer
                .encode(a[0].as_str().unwrap_or_default())
                .map_err(|e| BadRequest::new(e.to_string(), "prompt"))?,
            Some(_) => {
                return Err(BadRequest::new(
                    "`prompt` must be a string or a list of token ids",
                    "prompt",
                ));
            }
            None => return Err(BadRequest::new("`prompt` is required", "prompt")),
        };
        parse_common(&s, &body, prompt, 16)
    })();
    match r {
        Ok(p) => run(s, p, false).await,
        Err(BadRequest(code, msg, param)) => error(code, msg, param),
    }
}

async fn chat(State(s): State<Arc<AppState>>, body: Bytes) -> Response {
    let r = (|| {
        let body = parse_body(&body)?;
        let messages: Vec<ChatMessage> = match body.get("messages") {
            Some(Value::Array(a)) if !a.is_empty() => a
                .iter()
                .enumerate()
                .map(|(i, m)| {
                    let role = m.get("role").and_then(Value::as_str);
                    let content = match m.get("content") {
                        Some(Value::String(c)) => Some(c.clone()),
                        // A list of content parts: the text parts, concatenated.
                        Some(Value::Array(parts)) => Some(
                            parts
                                .iter()
                                .filter_map(|p| p.get("text").and_then(Value::as_str))
                                .collect::<String>(),
                        ),
                        _ => None,
                    };
                    match (role, content) {
                        (Some(r), Some(c)) => Ok(ChatMessage {
                            role: r.to_string(),
                            content: c,
                        }),
                        _ => Err(BadRequest::new(
                            format!("messages[{i}] needs a string `role` and a `content`"),
                            "messages",
                        )),
                    }
                })
                .collect::<Result<_, _>>()?,
            _ => return Err(BadRequest::new("`messages` must be a non-empty list", "messages")),
        };
        let text = s
            .template
            .render(&messages, true)
            .map_err(|e| BadRequest::new(e.to_string(), "messages"))?;
        let prompt = s
            .tokenizer
            .encode(&text)
            .map_err(|e| BadRequest::new(e.to_string(), "messages"))?;
        let room = s.context.saturating_sub(prompt.len()).clamp(1, 1024);
        parse_common(&s, &body, prompt, room)
    })();
    match r {
        Ok(p) => run(s, p, true).await,
        Err(BadRequest(code, msg, param)) => error(code, msg, param),
    }
}

/// `POST /v1/load_weights {"path", "version", "sha256"?}`: an in-flight weight update
/// (the rollout stage's `engine: openai://` sends the trainer's new versions here).
async fn load_weights(State(s): State<Arc<AppState>>, body: Bytes) -> Response {
    let body = match parse_body(&body) {
        Ok(b) => b,
        Err(BadRequest(code, msg, param)) => return error(code, msg, param),
    };
    let Some(path) = body.get("path").and_then(Value::as_str) else {
        return error(
            StatusCode::BAD_REQUEST,
            "`path` (a checkpoint directory) is required",
            Some("path"),
        );
    };
    let Some(version) = body
        .get("version")
        .and_then(Value::as_u64)
        .and_then(|v| u32::try_from(v).ok())
    else {
        return error(
            StatusCode::BAD_REQUEST,
            "`version` must be a non-negative integer",
            Some("version"),
        );
    };
    let sha256 = body.get("sha256").and_then(Value::as_str).map(str::to_string);
    let (reply, rx) = tokio::sync::oneshot::channel();
    if s.engine
        .send(Cmd::Load {
            dir: PathBuf::from(path),
            version,
            sha256,
            reply,
        })
        .is_err()
    {
        return error(StatusCode::SERVICE_UNAVAILABLE, "the engine has stopped", None);
    }
    match rx.await {
        Ok(Ok(v)) => axum::Json(json!({"version": v})).into_response(),
        Ok(Err(e)) => error(
            StatusCode::BAD_REQUEST,
            format!("the weights were not loaded (the old ones keep serving): {e}"),
            Some("path"),
        ),
        Err(_) => error(StatusCode::SERVICE_UNAVAILABLE, "the engine has stopped", None),
    }
}

fn finish_name(r: FinishReason, chat: bool) -> &'static str {
    match r {
        FinishReason::Length => "length",
        FinishReason::ToolCall if chat => "tool_calls",
        _ => "stop",
    }
}

async fn run(s: Arc<AppState>, p: Parsed, chat: bool) -> Response {
    let (tx, mut rx) = mpsc::unbounded_channel();
    let n = p.params.len();
    let hold = p.params[0].stop.iter().map(String::len).max().unwrap_or(0);
    for (index, params) in p.params.into_iter().enumerate() {
        let add = Add {
            prompt: p.prompt.clone(),
            params,
            index,
            events: tx.clone(),
        };
        if s.engine.send(Cmd::Add(add)).is_err() {
            return error(StatusCode::SERVICE_UNAVAILABLE, "the engine has stopped", None);
        }
    }
    drop(tx);
    let id = format!(
        "{}-{}",
        if chat { "chatcmpl" } else { "cmpl" },
        uuid::Uuid::new_v4().simple()
    );
    let created = now();
    let prompt_tokens = p.prompt.len();
    if p.stream {
        let st = s.clone();
        let mut tokens: Vec<Vec<u32>> = vec![Vec::new(); n];
        let mut sent: Vec<usize> = vec![0; n];
        let mut done = 0;
        let stream = async_stream(move |out: mpsc::UnboundedSender<String>| async move {
            let chunk = |index: usize, delta: &str, finish: Option<&str>, first: bool| -> String {
                let choice = if chat {
                    let mut d = json!({"content": delta});
                    if first {
                        d["role"] = json!("assistant");
                    }
                    json!({"index": index, "delta": d, "logprobs": null, "finish_reason": finish})
                } else {
                    json!({"index": index, "text": delta, "logprobs": null, "finish_reason": finish})
                };
                json!({"id": id, "object": if chat { "chat.completion.chunk" } else { "text_completion" },
                       "created": created, "model": st.model, "choices": [choice]})
                .to_string()
            };
            if chat {
                for i in 0..n {
                    let _ = out.send(chunk(i, "", None, true));
                }
            }
            while let Some((i, ev)) = rx.recv().await {
                match ev {
                    Ev::Token(t) => {
                        tokens[i].push(t);
                        let text = st.tokenizer.decode(&tokens[i]).unwrap_or_default();
                        let mut safe = text.len().saturating_sub(hold);
                        while !text.is_char_boundary(safe) {
                            safe -= 1;
                        }
                        if text[..safe].ends_with('\u{FFFD}') || safe <= sent[i] {
                            continue;
                        }
                        let _ = out.send(chunk(i, &text[sent[i]..safe], None, false));
                        sent[i] = safe;
                    }
                    Ev::Done(o) => {
                        let rest = o.text.get(sent[i]..).unwrap_or_default();
                        if !rest.is_empty() {
                            let _ = out.send(chunk(i, rest, None, false));
                        }
                        let _ = out.send(chunk(i, "", Some(finish_name(o.finish_reason, chat)), false));
                        done += 1;
                        if done == n {
                            break;
                        }
                    }
                    Ev::Error(e) => {
                        let _ = out.send(json!({"error": {"message": e, "type": "invalid_request_error", "param": null, "code": null}}).to_string());
                        break;
                    }
                }
            }
            let _ = out.send("[DONE]".to_string());
        });
        return Sse::new(stream).into_response();
    }
    let mut outputs: Vec<Option<Output>> = vec![None; n];
    while let Some((i, ev)) = rx.recv().await {
        match ev {
            Ev::Token(_) => {}
            Ev::Done(o) => outputs[i] = Some(o),
            Ev::Error(e) => return error(StatusCode::BAD_REQUEST, e, None),
        }
    }
    let outputs: Vec<Output> = outputs.into_iter().flatten().collect();
    let completion_tokens: usize = outputs.iter().map(|o| o.tokens.len()).sum();
    let choices: Vec<Value> = outputs
        .iter()
        .enumerate()
        .map(|(i, o)| {
            let pieces: Vec<String> = o
                .tokens
                .iter()
                .map(|t| {
                    if p.token_ids {
                        format!("token_id:{t}")
                    } else {
                        s.tokenizer.decode(std::slice::from_ref(t)).unwrap_or_default()
                    }
                })
                .collect();
            let finish = finish_name(o.finish_reason, chat);
            if chat {
                let logprobs = p.logprobs.then(|| {
                    json!({"content": pieces.iter().zip(&o.logprobs).map(|(tok, lp)| json!({
                        "token": tok, "logprob": lp, "bytes": tok.as_bytes(), "top_logprobs": []
                    })).collect::<Vec<_>>()})
                });
                json!({"index": i, "message": {"role": "assistant", "content": o.text},
                       "logprobs": logprobs, "finish_reason": finish})
            } else {
                let logprobs = p.logprobs.then(|| {
                    let mut offsets = Vec::with_capacity(pieces.len());
                    let mut at = 0;
                    for piece in &pieces {
                        offsets.push(at);
                        at += piece.len();
                    }
                    json!({"tokens": pieces, "token_logprobs": o.logprobs, "top_logprobs": null, "text_offset": offsets})
                });
                let mut c = json!({"index": i, "text": o.text, "logprobs": logprobs, "finish_reason": finish});
                if p.token_ids {
                    c["policy_versions"] = json!(o.versions);
                }
                c
            }
        })
        .collect();
    axum::Json(json!({
        "id": id,
        "object": if chat { "chat.completion" } else { "text_completion" },
        "created": created,
        "model": s.model,
        "choices": choices,
        "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                  "total_tokens": prompt_tokens + completion_tokens},
    }))
    .into_response()
}

/// A server-sent-event stream fed by a task that sends data strings.
fn async_stream<F, Fut>(
    f: F,
) -> impl futures::Stream<Item = std::result::Result<SseEvent, std::convert::Infallible>> + Send + 'static
where
    F: FnOnce(mpsc::UnboundedSender<String>) -> Fut,
    Fut: std::future::Future<Output = ()> + Send + 'static,
{
    let (tx, rx) = mpsc::unbounded_channel();
    tokio::spawn(f(tx));
    futures::stream::unfold(rx, |mut rx| async move {
        rx.recv().await.map(|data| (Ok(SseEvent::default().data(data)), rx))
    })
}
