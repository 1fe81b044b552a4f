//! `streamrl sandbox serve`: the sandbox gateway, an HTTP API over the warm sandbox pool
//! that agent harnesses call directly (no central queue in between).
//!
//! Every `/v1` route needs `Authorization: Bearer TOKEN`.
//!
//! | method and path | body | answer |
//! |---|---|---|
//! | `POST /v1/exec` | `{argv, stdin?, env?, cwd?, files?, limits?}` | a one-shot run in a fresh sandbox: the result |
//! | `POST /v1/sandboxes` | – | `201 {id}`: a session whose `/work` persists |
//! | `GET /v1/sandboxes` | – | the open sessions |
//! | `DELETE /v1/sandboxes/{id}` | – | `204` |
//! | `POST /v1/sandboxes/{id}/exec` | as `/v1/exec` without `files` | the result |
//! | `PUT /v1/sandboxes/{id}/files/{path}` | raw bytes | `204` |
//! | `GET /v1/sandboxes/{id}/files/{path}` | – | raw bytes |
//! | `GET /health` | – | `{status, ready, pool_size, in_flight, sessions}`: warm sandboxes ready, executions running (no token needed) |
//! | `GET /metrics` | – | Prometheus text: in flight, ready, pool size, sessions, executions and their seconds by status (no token needed) |
//!
//! A result is `{status, reason, exit_code, signal, stdout, stderr, wall_ms, cpu_ms,
//! peak_memory_bytes}`. `limits` may lower any field of the gateway's limits (a higher
//! value is a 400 naming the field). Errors are `{"error": {"message", "type"}}`.
//!
//! SIGTERM or SIGINT drains: the gateway stops accepting connections, answers the
//! requests it holds, and exits 0. The sandbox stage reaches a fleet of gateways by name
//! (`executor: gateways`, see `streamrl_stages::gateways`).

mod gateway;

use std::collections::HashMap;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use anyhow::{Context, Result, bail};
use axum::Json;
use axum::Router;
use axum::extract::DefaultBodyLimit;
use axum::http::StatusCode;
use axum::middleware;
use axum::routing::{get, post};
use clap::Subcommand;
use serde_json::json;
use streamrl_sandbox::{Pool, SandboxConfig};

use gateway::{
    Gateway, Session, Shared, auth, create, delete, error, exec_in, exec_once, get_file, json_errors, list, put_file,
};
#[derive(Subcommand)]
pub enum SandboxCmd {
    /// Serve the sandbox gateway over HTTP.
    Serve(ServeArgs),
}

#[derive(clap::Args)]
pub struct ServeArgs {
    /// Address to listen on.
    #[arg(long, default_value = "127.0.0.1:8090")]
    listen: SocketAddr,
    /// Bearer token clients must send (or set STREAMRL_SANDBOX_TOKEN).
    #[arg(long, env = "STREAMRL_SANDBOX_TOKEN", hide_env_values = true)]
    token: Option<String>,
    /// File holding the bearer token (first line).
    #[arg(long)]
    token_file: Option<PathBuf>,
    /// Sandbox configuration (YAML or JSON: a SandboxConfig); defaults otherwise.
    #[arg(long)]
    config: Option<PathBuf>,
    /// Sandboxes kept warm (overrides the configuration).
    #[arg(long)]
    pool_size: Option<usize>,
    /// Most sessions open at once.
    #[arg(long, default_value_t = 256)]
    max_sessions: usize,
    /// Sessions unused this long are deleted.
    #[arg(long, default_value_t = 600)]
    session_idle_secs: u64,
    /// Largest request body in bytes (uploads included).
    #[arg(long, default_value_t = 64 << 20)]
    max_body_bytes: usize,
}

fn load_config(path: Option<&PathBuf>) -> Result<SandboxConfig> {
    let Some(p) = path else {
        return Ok(SandboxConfig::default());
    };
    let text = std::fs::read_to_string(p).with_context(|| format!("reading {}", p.display()))?;
    serde_yaml::from_str(&text).with_context(|| format!("{} is not a sandbox configuration", p.display()))
}

/// The bearer token from `--token`, the environment or the first line of `--token-file`.
fn read_token(a: &ServeArgs) -> Result<String> {
    let token = match (&a.token, &a.token_file) {
        (Some(t), _) => t.clone(),
        (None, Some(f)) => std::fs::read_to_string(f)
            .with_context(|| format!("reading the token file {}", f.display()))?
            .lines()
            .next()
            .unwrap_or_default()
            .trim()
            .to_string(),
        (None, None) => bail!("the gateway needs a bearer token: --token, --token-file or STREAMRL_SANDBOX_TOKEN"),
    };
    if token.len() < 16 {
        bail!("the bearer token is {} characters; use at least 16", token.len());
    }
    Ok(token)
}

/// Deletes the sessions unused for `idle`, every second, for ever.
async fn reap_idle(g: Shared, idle: Duration) {
    loop {
        tokio::time::sleep(Duration::from_secs(1).min(idle)).await;
        let expired: Vec<Session> = {
            let mut s = g.sessions.lock().expect("sessions");
            let ids: Vec<String> = s
                .iter()
                .filter(|(_, v)| v.last_used.elapsed() >= idle)
                .map(|(k, _)| k.clone())
                .collect();
            ids.iter().filter_map(|id| s.remove(id)).collect()
        };
        for s in expired {
            g.close(s);
        }
    }
}

pub async fn run(cmd: SandboxCmd) -> Result<()> {
    let SandboxCmd::Serve(a) = cmd;
    let token = read_token(&a)?;
    let mut cfg = load_config(a.config.as_ref())?;
    if let Some(n) = a.pool_size {
        cfg.pool_size = n;
    }
    let pool = Arc::new(tokio::task::spawn_blocking(move || Pool::new(cfg)).await??);
    let g = Arc::new(Gateway {
        pool,
        token,
        sessions: Mutex::new(HashMap::new()),
        max_sessions: a.max_sessions,
        in_flight: AtomicUsize::new(0),
        ended: Mutex::new(Default::default()),
    });
    tokio::spawn(reap_idle(g.clone(), Duration::from_secs(a.session_idle_secs)));
    let v1 = Router::new()
        .route("/exec", post(exec_once))
        .route("/sandboxes", post(create).get(list))
        .route("/sandboxes/{id}", axum::routing::delete(delete))
        .route("/sandboxes/{id}/exec", post(exec_in))
        .route("/sandboxes/{id}/files/{*path}", get(get_file).put(put_file))
        .route_layer(middleware::from_fn_with_state(g.clone(), auth));
    let health = g.clone();
    let app = Router::new()
        .route(
            "/health",
            get(move || async move {
                Json(json!({
                    "status": "ok",
                    "ready": health.pool.ready(),
                    "pool_size": health.pool.config().pool_size,
                    "in_flight": health.in_flight.load(Ordering::Relaxed),
                    "sessions": health.sessions.lock().expect("sessions").len(),
                }))
            }),
        )
        .route(
            "/metrics",
            get({
                let g = g.clone();
                move || async move {
                    (
                        [(axum::http::header::CONTENT_TYPE, "text/plain; version=0.0.4")],
                        g.prometheus(),
                    )
                }
            }),
        )
        .nest("/v1", v1)
        .fallback(|| async { error(StatusCode::NOT_FOUND, "no such route") })
        .layer(DefaultBodyLimit::max(a.max_body_bytes))
        .layer(middleware::from_fn(json_errors))
        .with_state(g);
    let listener = tokio::net::TcpListener::bind(a.listen)
        .await
        .with_context(|| format!("listening on {}", a.listen))?;
    eprintln!("sandbox gateway on http://{}", listener.local_addr()?);
    super::serve::until_signalled(listener, app).await
}
