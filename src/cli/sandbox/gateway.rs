//! The gateway's state and route handlers: sessions over the warm pool, one-shot and
//! in-session execs, file transfer, bearer-token auth and JSON errors.

// Handlers' helpers return the HTTP error response itself as their `Err`.
#![allow(clippy::result_large_err)]

use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Instant;

use axum::Json;
use axum::body::Bytes;
use axum::extract::{Path, Request, State};
use axum::http::{HeaderMap, StatusCode, header};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use serde::Deserialize;
use serde_json::json;
use streamrl_sandbox::{ExecRequest, Limits, Pool, Sandbox};
use subtle::ConstantTimeEq as _;

pub(super) struct Session {
    pub(super) sandbox: Arc<Mutex<Sandbox>>,
    pub(super) last_used: Instant,
}

pub(super) struct Gateway {
    pub(super) pool: Arc<Pool>,
    pub(super) token: String,
    pub(super) sessions: Mutex<HashMap<String, Session>>,
    pub(super) max_sessions: usize,
    /// Executions running now (one-shot and in sessions), for `/health`.
    pub(super) in_flight: AtomicUsize,
    /// Executions ended, by status: (count, seconds in all), for `/metrics`.
    pub(super) ended: Mutex<BTreeMap<&'static str, (u64, f64)>>,
}

impl Gateway {
    /// Counts an execution that ended with `status` after `secs`.
    fn record(&self, status: &'static str, secs: f64) {
        let mut e = self.ended.lock().expect("metrics");
        let slot = e.entry(status).or_insert((0, 0.0));
        slot.0 += 1;
        slot.1 += secs;
    }

    /// The gateway's metrics in the Prometheus text format.
    pub(super) fn prometheus(&self) -> String {
        let mut out = String::new();
        let gauge = |out: &mut String, name: &str, help: &str, v: usize| {
            out.push_str(&format!("# HELP {name} {help}\n# TYPE {name} gauge\n{name} {v}\n"));
        };
        gauge(
            &mut out,
            "streamrl_gateway_in_flight",
            "Executions running now.",
            self.in_flight.load(Ordering::Relaxed),
        );
        gauge(
            &mut out,
            "streamrl_gateway_ready_sandboxes",
            "Warm sandboxes ready.",
            self.pool.ready(),
        );
        gauge(
            &mut out,
            "streamrl_gateway_pool_size",
            "Warm sandboxes the pool keeps.",
            self.pool.config().pool_size,
        );
        gauge(
            &mut out,
            "streamrl_gateway_sessions",
            "Open sessions.",
            self.sessions.lock().expect("sessions").len(),
        );
        let ended = self.ended.lock().expect("metrics");
        out.push_str("# HELP streamrl_gateway_executions_total Executions ended, by status.\n# TYPE streamrl_gateway_executions_total counter\n");
        for (status, (n, _)) in ended.iter() {
            out.push_str(&format!(
                "streamrl_gateway_executions_total{{status=\"{status}\"}} {n}\n"
            ));
        }
        out.push_str("# HELP streamrl_gateway_execution_seconds_total Seconds executions took, by status.\n# TYPE streamrl_gateway_execution_seconds_total counter\n");
        for (status, (_, secs)) in ended.iter() {
            out.push_str(&format!(
                "streamrl_gateway_execution_seconds_total{{status=\"{status}\"}} {secs}\n"
            ));
        }
        out
    }
}

/// Counts one execution in [`Gateway::in_flight`] while it lives.
struct Running<'a>(&'a AtomicUsize);

impl<'a> Running<'a> {
    fn start(n: &'a AtomicUsize) -> Running<'a> {
        n.fetch_add(1, Ordering::Relaxed);
        Running(n)
    }
}

impl Drop for Running<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::Relaxed);
    }
}

pub(super) type Shared = Arc<Gateway>;

impl Gateway {
    /// Closes a session: its sandbox goes back to the pool to be retired (once no exec
    /// holds it).
    pub(super) fn close(&self, s: Session) {
        if let Ok(sb) = Arc::try_unwrap(s.sandbox) {
            self.pool.retire(sb.into_inner().expect("sandbox lock"));
        }
    }
}

pub(super) fn error(status: StatusCode, message: impl Into<String>) -> Response {
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

pub(super) async fn auth(State(g): State<Shared>, headers: HeaderMap, req: Request, next: Next) -> Response {
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
pub(super) async fn json_errors(req: Request, next: Next) -> Response {
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

/// A handler's answer: its `Err` is the error response itself.
type Answer = Result<Response, Response>;

pub(super) async fn exec_once(State(g): State<Shared>, body: Bytes) -> Answer {
    let (req, files) = parse_exec(&g.pool.config().limits, &body, true)?;
    let _running = Running::start(&g.in_flight);
    let pool = g.pool.clone();
    let started = Instant::now();
    let result = blocking(move || {
        let files: Vec<(&str, &[u8])> = files.iter().map(|(k, v)| (k.as_str(), v.as_bytes())).collect();
        pool.exec_with_files(&files, &req)
    })
    .await?;
    g.record(result.status.as_str(), started.elapsed().as_secs_f64());
    Ok(Json(result).into_response())
}

pub(super) async fn create(State(g): State<Shared>) -> Answer {
    if g.sessions.lock().expect("sessions").len() >= g.max_sessions {
        return Err(error(
            StatusCode::TOO_MANY_REQUESTS,
            format!("{} sessions are open, the maximum", g.max_sessions),
        ));
    }
    let pool = g.pool.clone();
    let sandbox = blocking(move || pool.take())
        .await?
        .map_err(|e| error(StatusCode::INTERNAL_SERVER_ERROR, e.to_string()))?;
    let id = sandbox.id().to_string();
    g.sessions.lock().expect("sessions").insert(
        id.clone(),
        Session {
            sandbox: Arc::new(Mutex::new(sandbox)),
            last_used: Instant::now(),
        },
    );
    Ok((StatusCode::CREATED, Json(json!({"id": id}))).into_response())
}

pub(super) async fn list(State(g): State<Shared>) -> Response {
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

pub(super) async fn delete(State(g): State<Shared>, Path(id): Path<String>) -> Response {
    let removed = g.sessions.lock().expect("sessions").remove(&id);
    match removed {
        Some(s) => {
            g.close(s);
            StatusCode::NO_CONTENT.into_response()
        }
        None => error(StatusCode::NOT_FOUND, format!("no sandbox `{id}`")),
    }
}

pub(super) async fn exec_in(State(g): State<Shared>, Path(id): Path<String>, body: Bytes) -> Answer {
    let sb = session(&g, &id)?;
    let (req, _) = parse_exec(&g.pool.config().limits, &body, false)?;
    let _running = Running::start(&g.in_flight);
    let started = Instant::now();
    let result = blocking(move || sb.lock().expect("sandbox lock").exec(&req)).await?;
    g.record(result.status.as_str(), started.elapsed().as_secs_f64());
    Ok(Json(result).into_response())
}

/// The session `id`'s sandbox, for a file at `path` under its `/work`.
fn session_file(g: &Gateway, id: &str, path: &str) -> Result<Arc<Mutex<Sandbox>>, Response> {
    streamrl_sandbox::protocol::work_relative(path).map_err(|e| error(StatusCode::BAD_REQUEST, e))?;
    session(g, id)
}

pub(super) async fn put_file(State(g): State<Shared>, Path((id, path)): Path<(String, String)>, body: Bytes) -> Answer {
    let sb = session_file(&g, &id, &path)?;
    blocking(move || sb.lock().expect("sandbox lock").write_file(&path, &body, 0o644))
        .await?
        .map_err(|e| error(StatusCode::BAD_REQUEST, e.to_string()))?;
    Ok(StatusCode::NO_CONTENT.into_response())
}

pub(super) async fn get_file(State(g): State<Shared>, Path((id, path)): Path<(String, String)>) -> Answer {
    let sb = session_file(&g, &id, &path)?;
    let data = blocking(move || sb.lock().expect("sandbox lock").read_file(&path, 64 << 20))
        .await?
        .map_err(|e| error(StatusCode::NOT_FOUND, e.to_string()))?;
    Ok(([(header::CONTENT_TYPE, "application/octet-stream")], data).into_response())
}
