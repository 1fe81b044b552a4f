//! The routes: authentication, the OpenAI endpoints' request reading and checking, the
//! weight-update endpoint, and OpenAI-style error answers.

use std::sync::Arc;
use std::time::{SystemTime, UNIX_EPOCH};

use axum::body::Bytes;
use axum::extract::{Request, State};
use axum::http::StatusCode;
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use streamrl_model::chat::ChatMessage;
use streamrl_model::openai::{self, Checked, ErrorBody, LoadWeights, Loaded, ModelCard, ModelList, Problem};
use subtle::ConstantTimeEq as _;

use super::AppState;
use super::answer::run;
use super::engine::Cmd;

/// Checks `Authorization: Bearer <key>` (the scheme is case-insensitive, RFC 6750) when
/// the server has a key; 401 with an OpenAI-style body otherwise.
pub async fn authorize(State(s): State<Arc<AppState>>, req: Request, next: Next) -> Response {
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
                axum::Json(ErrorBody::new(
                    "invalid_request_error",
                    message,
                    None,
                    Some("invalid_api_key"),
                )),
            )
                .into_response()
        }
    }
}

/// An error answer with an OpenAI-style body.
pub fn error(status: StatusCode, message: impl Into<String>, param: Option<&str>) -> Response {
    let kind = if status == StatusCode::NOT_FOUND {
        "not_found_error"
    } else {
        "invalid_request_error"
    };
    (status, axum::Json(ErrorBody::new(kind, message, param, None))).into_response()
}

/// A 400 for one problem, boxed for `?`.
fn bad(p: Problem) -> Box<Response> {
    Box::new(refuse(vec![p]))
}

/// A 400 listing every problem; `param` is the first one's field.
fn refuse(p: Vec<Problem>) -> Response {
    let message = p.iter().map(|x| x.message.as_str()).collect::<Vec<_>>().join("; ");
    let param = p.first().map(|x| x.path.as_str()).filter(|x| !x.is_empty());
    error(StatusCode::BAD_REQUEST, message, param)
}

pub async fn models(State(s): State<Arc<AppState>>) -> Response {
    axum::Json(ModelList {
        object: "list".into(),
        data: vec![ModelCard {
            id: s.model.clone(),
            object: "model".into(),
            created: now(),
            owned_by: "streamrl".into(),
            max_model_len: Some(s.context),
        }],
    })
    .into_response()
}

/// Unix seconds.
pub fn now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}

/// A request both endpoints have read and checked.
pub struct Parsed {
    /// The prompt's tokens.
    pub prompt: Vec<u32>,
    /// The prompt's text (`echo`).
    pub prompt_text: String,
    /// What it asks for.
    pub c: Checked,
}

/// 404 for another model's name.
fn check_model(s: &AppState, req: &openai::Request) -> Result<(), Box<Response>> {
    match &req.model {
        Some(m) if *m != s.model => Err(Box::new(error(
            StatusCode::NOT_FOUND,
            format!("The model `{m}` does not exist; this server serves `{}`", s.model),
            Some("model"),
        ))),
        _ => Ok(()),
    }
}

pub async fn completions(State(s): State<Arc<AppState>>, body: Bytes) -> Response {
    let r: Result<Parsed, Box<Response>> = (|| {
        let req = openai::parse(&body).map_err(bad)?;
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

pub async fn chat(State(s): State<Arc<AppState>>, body: Bytes) -> Response {
    let r: Result<Parsed, Box<Response>> = (|| {
        let req = openai::parse(&body).map_err(bad)?;
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
/// (the rollout stage's `engine: {openai: ...}` sends the trainer's new versions here).
/// `path` is a checkpoint directory this server can read, or the `http://` URL of a
/// checkpoint a trainer serves (downloaded and checked first).
pub async fn load_weights(State(s): State<Arc<AppState>>, body: Bytes) -> Response {
    let load: LoadWeights = match openai::parse(&body) {
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
    // Read, checked and laid out here, while the engine thread goes on decoding; it
    // pauses only to swap the result in.
    let loader = s.loader.clone();
    let prepared = tokio::task::spawn_blocking(move || loader.load(&dir, version, load.sha256.as_deref()))
        .await
        .map_err(|e| e.to_string())
        .and_then(|r| r.map_err(|e| e.to_string()));
    let prepared = match prepared {
        Ok(p) => Box::new(p),
        Err(e) => {
            return error(
                StatusCode::BAD_REQUEST,
                format!("the weights were not loaded (the old ones keep serving): {e}"),
                Some("path"),
            );
        }
    };
    let (reply, rx) = tokio::sync::oneshot::channel();
    if s.engine.send(Cmd::Install { prepared, reply }).is_err() {
        return error(StatusCode::SERVICE_UNAVAILABLE, "the engine has stopped", None);
    }
    match rx.await {
        Ok(Ok(version)) => axum::Json(Loaded { version }).into_response(),
        Ok(Err(e)) => error(
            StatusCode::BAD_REQUEST,
            format!("the weights were not loaded (the old ones keep serving): {e}"),
            Some("path"),
        ),
        Err(_) => error(StatusCode::SERVICE_UNAVAILABLE, "the engine has stopped", None),
    }
}
