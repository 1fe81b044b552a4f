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
//! | `GET /health` | – | `{status, ready, sessions}` (no token needed) |
//!
//! A result is `{status, reason, exit_code, signal, stdout, stderr, wall_ms, cpu_ms,
//! peak_memory_bytes}`. `limits` may lower any field of the gateway's limits (a higher
//! value is a 400 naming the field). Errors are `{"error": {"message", "type"}}`.

// Handlers' helpers return the HTTP error response itself as their `Err`.
#![allow(clippy::result_large_err)]

use std::collections::{BTreeMap, HashMap};
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use axum::body::Bytes;
use axum::extract::{DefaultBodyLimit, Path, Request, State};
use axum::http::{HeaderMap, StatusCode, header};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use clap::Subcommand;
use serde::Deserialize;
use serde_json::json;
use streamrl_sandbox::{ExecRequest, Limits, Pool, Sandbox, SandboxConfig};
use subtle::ConstantTimeEq as _;

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

struct Session {
    sandbox: Arc<Mutex<Sandbox>>,
    last_used: Instant,
}

struct Gateway {
    pool: Arc<Pool>,
    token: String,
    sessions: Mutex<HashMap<String, Session>>,
    max_sessions: usize,
}

type Shared = Arc<Gateway>;

fn error(status: StatusCode, message: impl Into<String>) -> Response {
    let kind = match status {
        StatusCode::UNAUTHORIZED => "unauthorized",
        StatusCode::NOT_FOUND => "not_found",
        StatusCode::TOO_MANY_REQUESTS => "too_many_sessions",
        StatusCode::PAYLOAD_TOO_LARGE => "payload_too_large",
        s if s.is_server_error() => "internal_error",
        _ => "invalid_request",
    };
    (
        status,
        Json(json!({"error": {"message": message.into(), "type": kind}})),
    )
        .into_response()
}

/// The body of an exec.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct ExecBody {
    argv: Vec<String>,
    #[serde(default)]
    stdin: String,
    #[serde(default)]
    env: BTreeMap<String, String>,
    #[serde(default)]
    cwd: Option<String>,
    /// Files written under /work first (one-shot execs only): path → text.
    #[serde(default)]
    files: BTreeMap<String, String>,
    /// Fields that lower the gateway's limits.
    #[serde(default)]
    limits: serde_json::Map<String, serde_json::Value>,
}

fn parse_exec(
    max: &Limits,
    body: &[u8],
    allow_files: bool,
) -> Result<(ExecRequest, BTreeMap<String, String>), Response> {
    let b: ExecBody = serde_json::from_slice(body).map_err(|e| {
        error(
            StatusCode::BAD_REQUEST,
            format!("the body is not a valid exec request: {e}"),
        )
    })?;
    let mut errs = vec![];
    if b.argv.is_empty() || b.argv[0].is_empty() {
        errs.push("argv must name a program".to_string());
    }
    if !allow_files && !b.files.is_empty() {
        errs.push("files are uploaded to a session with PUT /v1/sandboxes/{id}/files/{path}".to_string());
    }
    for path in b.files.keys() {
        if let Err(e) = streamrl_sandbox::protocol::work_relative(path) {
            errs.push(format!("files: {e}"));
        }
    }
    let mut merged = serde_json::to_value(max).expect("serialisable");
    for (k, v) in &b.limits {
        merged[k] = v.clone();
    }
    let limits: Limits = match serde_json::from_value(merged) {
        Ok(l) => l,
        Err(e) => {
            errs.push(format!("limits: {e}"));
            *max
        }
    };
    errs.extend(limits.exceeding(max));
    if !errs.is_empty() {
        return Err(error(StatusCode::BAD_REQUEST, errs.join("; ")));
    }
    let req = ExecRequest {
        argv: b.argv,
        env: b.env,
        cwd: b.cwd,
        stdin: b.stdin.into_bytes(),
        limits,
    };
    Ok((req, b.files))
}

async fn auth(State(g): State<Shared>, headers: HeaderMap, req: Request, next: Next) -> Response {
    // RFC 6750 / RFC 9110: the scheme name is case-insensitive.
    let given = headers
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.trim().split_once(' '))
        .filter(|(scheme, _)| scheme.eq_ignore_ascii_case("bearer"))
        .map(|(_, token)| token.trim());
    match given {
        Some(t) if bool::from(t.as_bytes().ct_eq(g.token.as_bytes())) => next.run(req).await,
        Some(_) => error(StatusCode::UNAUTHORIZED, "the bearer token is wrong"),
        None => error(StatusCode::UNAUTHORIZED, "missing `Authorization: Bearer TOKEN` header"),
    }
}

/// Every error leaves the gateway as JSON, whoever produced it: the body-size limit
/// (413), axum's own rejections (405, a path it cannot parse) as well as the handlers.
async fn json_errors(req: Request, next: Next) -> Response {
    let resp = next.run(req).await;
    let status = resp.status();
    let is_json = resp
        .headers()
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v.starts_with("application/json"));
    if !(status.is_client_error() || status.is_server_error()) || is_json {
        return resp;
    }
    let text = match axum::body::to_bytes(resp.into_body(), 64 << 10).await {
        Ok(b) if !b.is_empty() => String::from_utf8_lossy(&b).trim().to_string(),
        _ => status.canonical_reason().unwrap_or("error").to_string(),
    };
    error(status, text)
}

async fn blocking<T: Send + 'static>(f: impl FnOnce() -> T + Send + 'static) -> Result<T, Response> {
    tokio::task::spawn_blocking(f)
        .await
        .map_err(|e| error(StatusCode::INTERNAL_SERVER_ERROR, format!("worker failed: {e}")))
}

async fn exec_once(State(g): State<Shared>, body: Bytes) -> Response {
    let (req, files) = match parse_exec(&g.pool.config().limits, &body, true) {
        Ok(r) => r,
        Err(e) => return e,
    };
    let pool = g.pool.clone();
    match blocking(move || {
        let files: Vec<(&str, &[u8])> = files.iter().map(|(k, v)| (k.as_str(), v.as_bytes())).collect();
        pool.exec_with_files(&files, &req)
    })
    .await
    {
        Ok(r) => Json(r).into_response(),
        Err(e) => e,
    }
}

async fn create(State(g): State<Shared>) -> Response {
    if g.sessions.lock().expect("sessions").len() >= g.max_sessions {
        return error(
            StatusCode::TOO_MANY_REQUESTS,
            format!("{} sessions are open, the maximum", g.max_sessions),
        );
    }
    let pool = g.pool.clone();
    let sandbox = match blocking(move || pool.take()).await {
        Ok(Ok(s)) => s,
        Ok(Err(e)) => return error(StatusCode::INTERNAL_SERVER_ERROR, e.to_string()),
        Err(e) => return e,
    };
    let id = sandbox.id().to_string();
    g.sessions.lock().expect("sessions").insert(
        id.clone(),
        Session {
            sandbox: Arc::new(Mutex::new(sandbox)),
            last_used: Instant::now(),
        },
    );
    (StatusCode::CREATED, Json(json!({"id": id}))).into_response()
}

async fn list(State(g): State<Shared>) -> Response {
    let s = g.sessions.lock().expect("sessions");
    let mut ids: Vec<_> = s
        .iter()
        .map(|(id, s)| json!({"id": id, "idle_secs": s.last_used.elapsed().as_secs()}))
        .collect();
    ids.sort_by_key(|v| v["id"].as_str().unwrap_or_default().to_string());
    Json(json!({"sandboxes": ids})).into_response()
}

fn session(g: &Gateway, id: &str) -> Result<Arc<Mutex<Sandbox>>, Response> {
    let mut s = g.sessions.lock().expect("sessions");
    match s.get_mut(id) {
        Some(sess) => {
            sess.last_used = Instant::now();
            Ok(sess.sandbox.clone())
        }
        None => Err(error(StatusCode::NOT_FOUND, format!("no sandbox `{id}`"))),
    }
}

async fn delete(State(g): State<Shared>, Path(id): Path<String>) -> Response {
    let removed = g.sessions.lock().expect("sessions").remove(&id);
    match removed {
        Some(s) => {
            let pool = g.pool.clone();
            if let Ok(sb) = Arc::try_unwrap(s.sandbox) {
                pool.retire(sb.into_inner().expect("sandbox lock"));
            }
            StatusCode::NO_CONTENT.into_response()
        }
        None => error(StatusCode::NOT_FOUND, format!("no sandbox `{id}`")),
    }
}

async fn exec_in(State(g): State<Shared>, Path(id): Path<String>, body: Bytes) -> Response {
    let sb = match session(&g, &id) {
        Ok(s) => s,
        Err(e) => return e,
    };
    let (req, _) = match parse_exec(&g.pool.config().limits, &body, false) {
        Ok(r) => r,
        Err(e) => return e,
    };
    match blocking(move || sb.lock().expect("sandbox lock").exec(&req)).await {
        Ok(r) => Json(r).into_response(),
        Err(e) => e,
    }
}

async fn put_file(State(g): State<Shared>, Path((id, path)): Path<(String, String)>, body: Bytes) -> Response {
    if let Err(e) = streamrl_sandbox::protocol::work_relative(&path) {
        return error(StatusCode::BAD_REQUEST, e);
    }
    let sb = match session(&g, &id) {
        Ok(s) => s,
        Err(e) => return e,
    };
    match blocking(move || sb.lock().expect("sandbox lock").write_file(&path, &body, 0o644)).await {
        Ok(Ok(())) => StatusCode::NO_CONTENT.into_response(),
        Ok(Err(e)) => error(StatusCode::BAD_REQUEST, e.to_string()),
        Err(e) => e,
    }
}

async fn get_file(State(g): State<Shared>, Path((id, path)): Path<(String, String)>) -> Response {
    if let Err(e) = streamrl_sandbox::protocol::work_relative(&path) {
        return error(StatusCode::BAD_REQUEST, e);
    }
    let sb = match session(&g, &id) {
        Ok(s) => s,
        Err(e) => return e,
    };
    match blocking(move || sb.lock().expect("sandbox lock").read_file(&path, 64 << 20)).await {
        Ok(Ok(data)) => ([(header::CONTENT_TYPE, "application/octet-stream")], data).into_response(),
        Ok(Err(e)) => error(StatusCode::NOT_FOUND, e.to_string()),
        Err(e) => e,
    }
}

fn load_config(path: Option<&PathBuf>) -> Result<SandboxConfig> {
    let Some(p) = path else {
        return Ok(SandboxConfig::default());
    };
    let text = std::fs::read_to_string(p).with_context(|| format!("reading {}", p.display()))?;
    serde_yaml::from_str(&text).with_context(|| format!("{} is not a sandbox configuration", p.display()))
}

pub async fn run(cmd: SandboxCmd) -> Result<()> {
    let SandboxCmd::Serve(a) = cmd;
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
    });
    // Idle sessions are reaped.
    let reaper = g.clone();
    let idle = Duration::from_secs(a.session_idle_secs);
    tokio::spawn(async move {
        loop {
            tokio::time::sleep(Duration::from_secs(1).min(idle)).await;
            let expired: Vec<Session> = {
                let mut s = reaper.sessions.lock().expect("sessions");
                let ids: Vec<String> = s
                    .iter()
                    .filter(|(_, v)| v.last_used.elapsed() >= idle)
                    .map(|(k, _)| k.clone())
                    .collect();
                ids.iter().filter_map(|id| s.remove(id)).collect()
            };
            for e in expired {
                if let Ok(sb) = Arc::try_unwrap(e.sandbox) {
                    reaper.pool.retire(sb.into_inner().expect("sandbox lock"));
                }
            }
        }
    });
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
                Json(json!({"status": "ok", "ready": health.pool.ready(), "sessions": health.sessions.lock().expect("sessions").len()}))
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
