//! `streamrl serve`: an OpenAI-compatible HTTP server over the continuous-batching engine.
//!
//! One engine thread owns the model; HTTP handlers send it requests over a channel and
//! receive per-token events back, so concurrent requests (and the `n` choices of one
//! request) share every decode step. Routes: `POST /v1/completions`,
//! `POST /v1/chat/completions` (both with `n`, `logprobs` with alternatives, `stop`,
//! `seed`, `usage` and server-sent-event streaming that carries logprobs and, with
//! `stream_options.include_usage`, a last usage chunk; completions also `echo`, with the
//! prompt's logprobs), `POST /v1/load_weights` (an in-flight weight update:
//! `{path, version, sha256}`), `GET /v1/models`, `GET /health`. vLLM's
//! `return_tokens_as_token_ids` (plus per-token `policy_versions`), `ignore_eos`,
//! `stop_token_ids` and `include_stop_str_in_output` extensions are understood. Request
//! bodies are typed ([`wire`]): a wrongly typed or out-of-range field is a 400 with an
//! OpenAI-style `{"error": {"message", "type", "param", "code"}}` body naming it. With
//! `--api-key` (or `STREAMRL_API_KEY`) every route but `/health` needs
//! `Authorization: Bearer <key>`.
//!
//! The end-of-sequence or stop token that ends a choice is not part of its text, so it is
//! not in its logprobs or its stream either; with `return_tokens_as_token_ids` (the
//! rollout stage's mode, which trains on it) it stays in the logprobs.

pub mod wire;

use std::collections::HashMap;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{SystemTime, UNIX_EPOCH};

use anyhow::{Context, Result, anyhow};
use axum::Router;
use axum::body::Bytes;
use axum::extract::{Request, State};
use axum::http::StatusCode;
use axum::middleware::Next;
use axum::response::sse::{Event as SseEvent, Sse};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use clap::Args;
use serde_json::{Value, json};
use streamrl_model::Tokenizer;
use streamrl_model::chat::{ChatMessage, ChatTemplate};
use streamrl_model::engine::{Engine, EngineConfig, Event, FinishReason, Output, PromptScores, SamplingParams};
use subtle::ConstantTimeEq as _;
use tokio::sync::mpsc;

use wire::{Checked, Problem};

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
    /// Require `Authorization: Bearer <key>` on every route but /health.
    #[arg(long, env = "STREAMRL_API_KEY", hide_env_values = true)]
    api_key: Option<String>,
    #[command(flatten)]
    placement: crate::cli::Placement,
}

/// One generated token as the engine reported it.
struct Tok {
    token: u32,
    logprob: f32,
    top: Vec<(u32, f32)>,
}

enum Ev {
    Token(Tok),
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
    /// Score a prompt (`echo` with `logprobs`).
    Score {
        prompt: Vec<u32>,
        top: usize,
        reply: tokio::sync::oneshot::Sender<Result<PromptScores, String>>,
    },
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
    vocab: usize,
    api_key: Option<String>,
    /// Downloads `http://` checkpoints (`load_weights` with a URL) into `weights`.
    http: reqwest::Client,
    weights: tempfile::TempDir,
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
                Cmd::Score { prompt, top, reply } => {
                    let _ = reply.send(engine.prompt_logprobs(&prompt, top).map_err(|e| e.to_string()));
                }
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
                Event::Token {
                    id,
                    token,
                    logprob,
                    top,
                    ..
                } => {
                    if let Some((i, tx)) = routes.get(&id)
                        && tx.send((*i, Ev::Token(Tok { token, logprob, top }))).is_err()
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
    let loaded = a
        .placement
        .load(&a.checkpoint)
        .with_context(|| format!("loading {}", a.checkpoint.display()))?;
    let tokenizer = loaded
        .tokenizer
        .ok_or_else(|| anyhow!("{} has no tokenizer.json", a.checkpoint.display()))?;
    let template = ChatTemplate::for_checkpoint(&a.checkpoint)?;
    let context = loaded.config.max_positions;
    let vocab = loaded.config.vocab;
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
    if a.api_key.as_deref() == Some("") {
        anyhow::bail!("--api-key (or STREAMRL_API_KEY) is set but empty");
    }
    let state = Arc::new(AppState {
        engine: tx,
        tokenizer,
        template,
        model,
        context,
        vocab,
        api_key: a.api_key,
        http: reqwest::Client::new(),
        weights: tempfile::Builder::new().prefix("streamrl-serve-weights-").tempdir()?,
    });
    // Every route but /health is behind the key (the fallback too: unknown paths do not
    // tell an unauthenticated caller which routes exist).
    let app = Router::new()
        .route("/v1/models", get(models))
        .route("/v1/completions", post(completions))
        .route("/v1/chat/completions", post(chat))
        .route("/v1/load_weights", post(load_weights))
        .fallback(|| async { error(StatusCode::NOT_FOUND, "no such route", None) })
        .layer(axum::middleware::from_fn_with_state(state.clone(), authorize))
        .route("/health", get(|| async { axum::Json(json!({"status": "ok"})) }))
        .with_state(state.clone());
    let listener = tokio::net::TcpListener::bind(a.listen)
        .await
        .with_context(|| format!("listening on {}", a.listen))?;
    eprintln!(
        "serving `{}` from {} on http://{} ({kernels} kernels{})",
        state.model,
        a.checkpoint.display(),
        listener.local_addr()?,
        if state.api_key.is_some() {
            ", API key required"
        } else {
            ""
        }
    );
    until_signalled(listener, app).await
}

/// Serves `app` on `listener` until SIGINT or SIGTERM, then finishes the requests in
/// flight (`streamrl serve` and `streamrl sandbox serve`).
pub async fn until_signalled(listener: tokio::net::TcpListener, app: Router) -> Result<()> {
    let shutdown = streamrl_runtime::runner::Shutdown::new();
    shutdown.on_signals();
    // Streamed tokens and small answers go out at once (no Nagle + delayed-ACK stalls).
    let listener = axum::serve::ListenerExt::tap_io(listener, |tcp| {
        let _ = tcp.set_nodelay(true);
    });
    axum::serve(listener, app)
        .with_graceful_shutdown(async move { shutdown.wait().await })
        .await?;
    Ok(())
}

/// Checks `Authorization: Bearer <key>` (the scheme is case-insensitive, RFC 6750) when
/// the server has a key; 401 with an OpenAI-style body otherwise.
async fn authorize(State(s): State<Arc<AppState>>, req: Request, next: Next) -> Response {
    let Some(want) = &s.api_key else {
        return next.run(req).await;
    };
    let given = req
        .headers()
        .get(axum::http::header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.split_once(' '))
        .filter(|(scheme, _)| scheme.eq_ignore_ascii_case("bearer"))
        .map(|(_, key)| key.trim());
    match given {
        Some(key) if bool::from(key.as_bytes().ct_eq(want.as_bytes())) => next.run(req).await,
        given => {
            let message = if given.is_some() {
                "Incorrect API key provided"
            } else {
                "Missing API key: send `Authorization: Bearer <key>`"
            };
            (
                StatusCode::UNAUTHORIZED,
                [(axum::http::header::WWW_AUTHENTICATE, "Bearer")],
                axum::Json(json!({"error": {"message": message, "type": "invalid_request_error",
                                            "param": null, "code": "invalid_api_key"}})),
            )
                .into_response()
        }
    }
}

/// Compares without an early exit on the first differing byte.
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

/// A 400 for one problem, boxed for `?`.
fn bad(p: Problem) -> Box<Response> {
    Box::new(refuse(vec![p]))
}

/// A 400 listing every problem; `param` is the first one's field.
fn refuse(p: Vec<Problem>) -> Response {
    let message = p.iter().map(|x| x.message.as_str()).collect::<Vec<_>>().join("; ");
    let param = p.first().map(|x| x.param.as_str()).filter(|x| !x.is_empty());
    error(StatusCode::BAD_REQUEST, message, param)
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

/// A request both endpoints have read and checked.
struct Parsed {
    prompt: Vec<u32>,
    /// The prompt's text (`echo`).
    prompt_text: String,
    c: Checked,
}

/// 404 for another model's name.
fn check_model(s: &AppState, req: &wire::Request) -> Result<(), Box<Response>> {
    match &req.model {
        Some(m) if *m != s.model => Err(Box::new(error(
            StatusCode::NOT_FOUND,
            format!("The model `{m}` does not exist; this server serves `{}`", s.model),
            Some("model"),
        ))),
        _ => Ok(()),
    }
}

async fn completions(State(s): State<Arc<AppState>>, body: Bytes) -> Response {
    let r: Result<Parsed, Box<Response>> = (|| {
        let req = wire::parse(&body).map_err(bad)?;
        check_model(&s, &req)?;
        let prompt = req
            .prompt_ids(s.vocab, |t| s.tokenizer.encode(t).map_err(|e| e.to_string()))
            .map_err(bad)?;
        let c = req
            .check(false, prompt.len(), s.context, 16)
            .map_err(|p| Box::new(refuse(p)))?;
        let prompt_text = if c.echo {
            s.tokenizer
                .decode(&prompt)
                .map_err(|e| bad(Problem::new("prompt", e.to_string())))?
        } else {
            String::new()
        };
        Ok(Parsed { prompt, prompt_text, c })
    })();
    match r {
        Ok(p) => run(s, p, false).await,
        Err(r) => *r,
    }
}

async fn chat(State(s): State<Arc<AppState>>, body: Bytes) -> Response {
    let r: Result<Parsed, Box<Response>> = (|| {
        let req = wire::parse(&body).map_err(bad)?;
        check_model(&s, &req)?;
        let messages: Vec<ChatMessage> = req
            .chat_messages()
            .map_err(bad)?
            .into_iter()
            .map(|(role, content)| ChatMessage { role, content })
            .collect();
        let text = s
            .template
            .render(&messages, true)
            .map_err(|e| bad(Problem::new("messages", e.to_string())))?;
        let prompt = s
            .tokenizer
            .encode(&text)
            .map_err(|e| bad(Problem::new("messages", e.to_string())))?;
        let room = s.context.saturating_sub(prompt.len()).clamp(1, 1024);
        let c = req
            .check(true, prompt.len(), s.context, room)
            .map_err(|p| Box::new(refuse(p)))?;
        Ok(Parsed {
            prompt,
            prompt_text: String::new(),
            c,
        })
    })();
    match r {
        Ok(p) => run(s, p, true).await,
        Err(r) => *r,
    }
}

/// `POST /v1/load_weights {"path", "version", "sha256"?}`: an in-flight weight update
/// (the rollout stage's `engine: openai://` sends the trainer's new versions here).
/// `path` is a checkpoint directory this server can read, or the `http://` URL of a
/// checkpoint a trainer serves (downloaded and checked first).
async fn load_weights(State(s): State<Arc<AppState>>, body: Bytes) -> Response {
    #[derive(serde::Deserialize)]
    struct Load {
        path: Option<String>,
        version: Option<u32>,
        sha256: Option<String>,
    }
    let load: Load = match wire::parse(&body) {
        Ok(l) => l,
        Err(p) => return refuse(vec![p]),
    };
    let Some(path) = load.path else {
        return error(
            StatusCode::BAD_REQUEST,
            "`path` (a checkpoint directory) is required",
            Some("path"),
        );
    };
    let Some(version) = load.version else {
        return error(
            StatusCode::BAD_REQUEST,
            "`version` (a non-negative 32-bit integer) is required",
            Some("version"),
        );
    };
    let dir = match streamrl_stages::weights::fetch(&s.http, &path, s.weights.path()).await {
        Ok(d) => d,
        Err(e) => {
            return error(
                StatusCode::BAD_REQUEST,
                format!("the weights were not loaded (the old ones keep serving): {e}"),
                Some("path"),
            );
        }
    };
    let (reply, rx) = tokio::sync::oneshot::channel();
    if s.engine
        .send(Cmd::Load {
            dir,
            version,
            sha256: load.sha256,
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

/// Choice `index`'s sampling parameters.
fn sampling(c: &Checked, index: usize) -> SamplingParams {
    // vLLM's include_stop_str_in_output keeps the stop string in the text: the engine's
    // tool-call stops do exactly that.
    let (stop, kept) = if c.keep_stop {
        (vec![], c.stop.clone())
    } else {
        (c.stop.clone(), vec![])
    };
    SamplingParams {
        temperature: c.temperature,
        top_p: c.top_p,
        top_k: c.top_k,
        seed: c.seed.map_or_else(rand::random, |s| s.wrapping_add(index as u64)),
        max_tokens: c.max_tokens,
        stop,
        tool_call_stop: kept,
        stop_token_ids: c.stop_token_ids.clone(),
        ignore_eos: c.ignore_eos,
        logprobs: c.logprobs.unwrap_or(0),
    }
}

/// One logprob entry: a token, its logprob (none for the first prompt token) and the
/// alternatives at its position.
struct Entry<'a> {
    token: u32,
    logprob: Option<f32>,
    top: Option<&'a [(u32, f32)]>,
}

/// Renders tokens and logprobs in the endpoint's format.
struct Render<'a> {
    tokenizer: &'a Tokenizer,
    eos: Option<u32>,
    chat: bool,
    c: &'a Checked,
    /// The choices' sampling parameters (which tokens end a choice).
    params: SamplingParams,
}

impl Render<'_> {
    /// A token as text, or `token_id:N`.
    fn piece(&self, t: u32) -> String {
        if self.c.token_ids {
            format!("token_id:{t}")
        } else {
            self.tokenizer.decode(std::slice::from_ref(&t)).unwrap_or_default()
        }
    }

    /// Whether `t` ends a choice without being part of its text.
    fn is_stop_token(&self, t: u32) -> bool {
        self.params.ends_at(t, self.eos)
    }

    /// How many of `o`'s tokens its logprobs show: all but a final stop token (which the
    /// text leaves out), except in `token_ids` mode, whose callers train on it.
    fn shown(&self, o: &Output) -> usize {
        match o.tokens.last() {
            Some(&t) if !self.c.token_ids && o.finish_reason == FinishReason::Stop && self.is_stop_token(t) => {
                o.tokens.len() - 1
            }
            _ => o.tokens.len(),
        }
    }

    /// The `logprobs` object for `entries`; completions' `text_offset` starts at `offset`,
    /// which moves past them.
    fn logprobs(&self, entries: &[Entry], offset: &mut usize) -> Value {
        if self.chat {
            let content: Vec<Value> = entries
                .iter()
                .map(|e| {
                    let piece = self.piece(e.token);
                    let top: Vec<Value> = e
                        .top
                        .unwrap_or_default()
                        .iter()
                        .map(|(t, lp)| {
                            let p = self.piece(*t);
                            json!({"token": p, "logprob": lp, "bytes": p.as_bytes()})
                        })
                        .collect();
                    json!({"token": piece, "logprob": e.logprob, "bytes": piece.as_bytes(), "top_logprobs": top})
                })
                .collect();
            return json!({"content": content, "refusal": null});
        }
        let (mut tokens, mut lps, mut tops, mut offsets) = (vec![], vec![], vec![], vec![]);
        for e in entries {
            let piece = self.piece(e.token);
            offsets.push(*offset);
            *offset += piece.len();
            // The sampled token is always among its position's alternatives.
            tops.push(e.top.map(|top| {
                let mut m = serde_json::Map::new();
                for (t, lp) in top {
                    m.insert(self.piece(*t), json!(lp));
                }
                if let Some(lp) = e.logprob {
                    m.entry(piece.clone()).or_insert(json!(lp));
                }
                Value::Object(m)
            }));
            lps.push(e.logprob);
            tokens.push(piece);
        }
        json!({"tokens": tokens, "token_logprobs": lps, "top_logprobs": tops, "text_offset": offsets})
    }
}

/// The echoed prompt's entries: the first token has no logprob.
fn prompt_entries<'a>(prompt: &[u32], scores: Option<&'a PromptScores>) -> Vec<Entry<'a>> {
    prompt
        .iter()
        .enumerate()
        .map(|(i, &token)| {
            let s = i.checked_sub(1).and_then(|j| scores.and_then(|s| s.get(j)));
            Entry {
                token,
                logprob: s.map(|s| s.0),
                top: s.map(|s| s.1.as_slice()),
            }
        })
        .collect()
}

async fn run(s: Arc<AppState>, p: Parsed, chat: bool) -> Response {
    let c = p.c;
    // `echo` with logprobs scores the prompt first.
    let scores = if c.echo && c.logprobs.is_some() {
        let (reply, rx) = tokio::sync::oneshot::channel();
        let cmd = Cmd::Score {
            prompt: p.prompt.clone(),
            top: c.logprobs.unwrap_or(0),
            reply,
        };
        if s.engine.send(cmd).is_err() {
            return error(StatusCode::SERVICE_UNAVAILABLE, "the engine has stopped", None);
        }
        match rx.await {
            Ok(Ok(v)) => Some(v),
            Ok(Err(e)) => return error(StatusCode::BAD_REQUEST, e, Some("prompt")),
            Err(_) => return error(StatusCode::SERVICE_UNAVAILABLE, "the engine has stopped", None),
        }
    } else {
        None
    };
    let (tx, mut rx) = mpsc::unbounded_channel();
    let n = c.n;
    // `max_tokens: 0` (only with echo) generates nothing: every choice is the prompt.
    if c.max_tokens > 0 {
        for index in 0..n {
            let add = Add {
                prompt: p.prompt.clone(),
                params: sampling(&c, index),
                index,
                events: tx.clone(),
            };
            if s.engine.send(Cmd::Add(add)).is_err() {
                return error(StatusCode::SERVICE_UNAVAILABLE, "the engine has stopped", None);
            }
        }
    } else {
        for index in 0..n {
            let _ = tx.send((index, Ev::Done(empty_output(p.prompt.len()))));
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
    if c.stream {
        let st = s.clone();
        let stream = async_stream(move |out: mpsc::UnboundedSender<String>| async move {
            let r = Render {
                tokenizer: &st.tokenizer,
                eos: st.tokenizer.eos,
                chat,
                c: &c,
                params: sampling(&c, 0),
            };
            let chunk = |index: usize, delta: &str, logprobs: Value, finish: Option<&str>, first: bool| -> String {
                let choice = if chat {
                    let mut d = json!({"content": delta});
                    if first {
                        d["role"] = json!("assistant");
                    }
                    json!({"index": index, "delta": d, "logprobs": logprobs, "finish_reason": finish})
                } else {
                    json!({"index": index, "text": delta, "logprobs": logprobs, "finish_reason": finish})
                };
                let mut v = json!({"id": id, "object": if chat { "chat.completion.chunk" } else { "text_completion" },
                                   "created": created, "model": st.model, "choices": [choice]});
                if c.include_usage {
                    v["usage"] = Value::Null;
                }
                v.to_string()
            };
            let hold = c.stop.iter().map(String::len).max().unwrap_or(0);
            // Per choice: the tokens of its text, how much text was sent, the tokens whose
            // logprobs wait for the text they belong to, the next text offset.
            let mut text_tokens: Vec<Vec<u32>> = vec![Vec::new(); n];
            let mut sent: Vec<usize> = vec![0; n];
            let mut pending: Vec<Vec<Tok>> = (0..n).map(|_| Vec::new()).collect();
            let mut offset: Vec<usize> = vec![0; n];
            let mut completion_tokens = 0;
            let lp = |r: &Render, toks: &[Tok], offset: &mut usize| -> Value {
                if c.logprobs.is_none() {
                    return Value::Null;
                }
                let entries: Vec<Entry> = toks
                    .iter()
                    .map(|t| Entry {
                        token: t.token,
                        logprob: Some(t.logprob),
                        top: Some(&t.top),
                    })
                    .collect();
                r.logprobs(&entries, offset)
            };
            for (i, off) in offset.iter_mut().enumerate() {
                if chat {
                    let _ = out.send(chunk(i, "", Value::Null, None, true));
                } else if c.echo {
                    let logprobs = if c.logprobs.is_some() {
                        r.logprobs(&prompt_entries(&p.prompt, scores.as_ref()), off)
                    } else {
                        Value::Null
                    };
                    let _ = out.send(chunk(i, &p.prompt_text, logprobs, None, false));
                }
            }
            let mut done = 0;
            while let Some((i, ev)) = rx.recv().await {
                match ev {
                    Ev::Token(t) => {
                        let stop_token = r.is_stop_token(t.token);
                        if !stop_token {
                            text_tokens[i].push(t.token);
                        }
                        if !stop_token || c.token_ids {
                            pending[i].push(t);
                        }
                        if stop_token {
                            continue;
                        }
                        let text = st.tokenizer.decode(&text_tokens[i]).unwrap_or_default();
                        let mut safe = text.len().saturating_sub(hold);
                        while !text.is_char_boundary(safe) {
                            safe -= 1;
                        }
                        if text[..safe].ends_with('\u{FFFD}') || safe <= sent[i] {
                            continue;
                        }
                        let logprobs = lp(&r, &pending[i], &mut offset[i]);
                        pending[i].clear();
                        let _ = out.send(chunk(i, &text[sent[i]..safe], logprobs, None, false));
                        sent[i] = safe;
                    }
                    Ev::Done(o) => {
                        completion_tokens += o.tokens.len();
                        let rest = o.text.get(sent[i]..).unwrap_or_default();
                        if !rest.is_empty() || !pending[i].is_empty() {
                            let logprobs = lp(&r, &pending[i], &mut offset[i]);
                            pending[i].clear();
                            let _ = out.send(chunk(i, rest, logprobs, None, false));
                        }
                        let _ = out.send(chunk(
                            i,
                            "",
                            Value::Null,
                            Some(finish_name(o.finish_reason, chat)),
                            false,
                        ));
                        done += 1;
                        if done == n {
                            break;
                        }
                    }
                    Ev::Error(e) => {
                        let _ = out.send(json!({"error": {"message": e, "type": "invalid_request_error", "param": null, "code": null}}).to_string());
                        let _ = out.send("[DONE]".to_string());
                        return;
                    }
                }
            }
            if c.include_usage {
                let v = json!({"id": id, "object": if chat { "chat.completion.chunk" } else { "text_completion" },
                               "created": created, "model": st.model, "choices": [],
                               "usage": usage(prompt_tokens, completion_tokens)});
                let _ = out.send(v.to_string());
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
    let r = Render {
        tokenizer: &s.tokenizer,
        eos: s.tokenizer.eos,
        chat,
        c: &c,
        params: sampling(&c, 0),
    };
    let choices: Vec<Value> = outputs
        .iter()
        .enumerate()
        .map(|(i, o)| {
            let finish = finish_name(o.finish_reason, chat);
            let logprobs = c.logprobs.map(|_| {
                let mut entries = if c.echo {
                    prompt_entries(&p.prompt, scores.as_ref())
                } else {
                    Vec::new()
                };
                let k = r.shown(o);
                entries.extend((0..k).map(|j| Entry {
                    token: o.tokens[j],
                    logprob: Some(o.logprobs[j]),
                    top: o.top_logprobs.get(j).map(Vec::as_slice),
                }));
                r.logprobs(&entries, &mut 0)
            });
            if chat {
                json!({"index": i, "message": {"role": "assistant", "content": o.text},
                       "logprobs": logprobs, "finish_reason": finish})
            } else {
                let text = format!("{}{}", p.prompt_text, o.text);
                let mut c = json!({"index": i, "text": text, "logprobs": logprobs, "finish_reason": finish});
                if r.c.token_ids {
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
        "usage": usage(prompt_tokens, completion_tokens),
    }))
    .into_response()
}

fn usage(prompt_tokens: usize, completion_tokens: usize) -> Value {
    json!({"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
           "total_tokens": prompt_tokens + completion_tokens})
}

/// A choice that generated nothing (`max_tokens: 0` with `echo`).
fn empty_output(prompt_len: usize) -> Output {
    Output {
        id: 0,
        prompt_len,
        tokens: Vec::new(),
        logprobs: Vec::new(),
        top_logprobs: Vec::new(),
        versions: Vec::new(),
        text: String::new(),
        finish_reason: FinishReason::Length,
        queued_at: 0,
        started_at: 0,
        finished_at: 0,
    }
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
