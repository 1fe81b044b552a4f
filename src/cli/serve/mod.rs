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
//! and answer bodies are typed ([`streamrl_model::openai`]): a wrongly typed or out-of-range field is a 400 with an
//! OpenAI-style `{"error": {"message", "type", "param", "code"}}` body naming it. With
//! `--api-key` (or `STREAMRL_API_KEY`) every route but `/health` needs
//! `Authorization: Bearer <key>`.
//!
//! The end-of-sequence or stop token that ends a choice is not part of its text, so it is
//! not in its logprobs or its stream either; with `return_tokens_as_token_ids` (the
//! rollout stage's mode, which trains on it) it stays in the logprobs.

mod answer;
mod engine;
mod routes;
mod stream;

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;

use anyhow::{Context, Result, anyhow};
use axum::Router;
use axum::http::StatusCode;
use axum::routing::{get, post};
use clap::Args;
use serde_json::json;
use streamrl_model::Tokenizer;
use streamrl_model::chat::ChatTemplate;
use streamrl_model::engine::{Engine, EngineConfig, WeightLoader};

use engine::{Cmd, engine_loop};
use routes::{authorize, chat, completions, error, load_weights, models};

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

struct AppState {
    engine: std::sync::mpsc::Sender<Cmd>,
    /// Prepares `load_weights` versions for the engine, off its thread.
    loader: WeightLoader,
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
    let loader = engine.loader();
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
        loader,
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
