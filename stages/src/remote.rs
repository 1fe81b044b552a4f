//! A remote OpenAI-compatible server as the rollout stage's engine
//! (`engine: {openai: {url: http://host:port}}`): `streamrl serve`, or vLLM / SGLang.
//!
//! Each sample is one `POST /v1/completions` with the prompt as token ids, the sample's
//! seed, `logprobs: 1` and vLLM's `return_tokens_as_token_ids`, so completion token ids and
//! their logprobs come back exactly. Tool-call markers are sent as stop strings with
//! `include_stop_str_in_output`, so a turn that ends in a call keeps its marker and is
//! reported as `tool_call`. `streamrl serve` also returns each token's policy version
//! (`policy_versions`); for other servers every token gets the version last pushed.
//!
//! A request that fails (the server unreachable, an error answer, an answer without
//! token ids) is sent again after a backoff (0.2 s, doubling), up to [`ATTEMPTS`] times in
//! all, while the other requests go on; only then does [`RemoteEngine::next`] report it.
//!
//! Weight updates: with `sync_weights`, each new policy version is sent to
//! `POST /v1/load_weights {path, version, sha256}` (streamrl serve: an in-flight update
//! between two decode steps; the checkpoint path must be readable by the server). Other
//! servers need their own weight sync; turn `sync_weights` off for them.

use std::collections::HashMap;
use std::time::Duration;

use serde::Serialize;
use streamrl_model::engine::{Output, SamplingParams};
use streamrl_model::openai::{LoadWeights, Request, TextCompletion};
use tokio::task::JoinSet;

use crate::now_ms;

/// Attempts per request before [`RemoteEngine::next`] reports its error.
pub const ATTEMPTS: u32 = 5;

/// The rollout stage's remote engine.
#[derive(Debug)]
pub struct RemoteEngine {
    client: reqwest::Client,
    base: String,
    model: Option<String>,
    tasks: JoinSet<(u64, Result<Output, String>)>,
    /// Requests in flight, kept for retries: prompt, parameters, attempts so far.
    sent: HashMap<u64, (Vec<u32>, SamplingParams, u32)>,
    next_id: u64,
    /// The policy version the server serves, as far as this stage knows.
    version: u32,
}

/// `openai://host:port[/prefix]` (or `http://…`) as the server's base URL.
pub fn base_url(url: &str) -> Result<String, String> {
    let rest = url
        .strip_prefix("openai://")
        .or_else(|| url.strip_prefix("http://"))
        .ok_or_else(|| format!("engine `{url}`: expected openai://host:port or http://host:port"))?;
    let rest = rest.trim_end_matches('/');
    if rest.is_empty() || !rest.split('/').next().is_some_and(|h| h.contains(':')) {
        return Err(format!("engine `{url}`: expected a host:port"));
    }
    Ok(format!("http://{rest}"))
}

/// Reads a completions answer's first choice as request `id`'s output.
fn read_answer(
    url: &str,
    bytes: &[u8],
    id: u64,
    prompt_len: usize,
    params: &SamplingParams,
    version: u32,
) -> Result<Output, String> {
    let answer: TextCompletion = serde_json::from_slice(bytes).map_err(|e| {
        format!(
            "POST {url}: the answer is not a completion ({e}): {}",
            String::from_utf8_lossy(bytes)
        )
    })?;
    let choice = answer
        .choices
        .into_iter()
        .next()
        .ok_or_else(|| format!("POST {url}: no choices in the answer"))?;
    choice.into_output(id, prompt_len, params, version)
}

/// POSTs a JSON body; the answer's bytes on a 2xx, else an error naming the URL, the
/// status and the server's answer.
async fn post_json(client: &reqwest::Client, url: &str, body: &impl Serialize) -> Result<Vec<u8>, String> {
    let body = serde_json::to_vec(body).map_err(|e| format!("POST {url}: {e}"))?;
    let resp = client
        .post(url)
        .header("content-type", "application/json")
        .body(body)
        .send()
        .await
        .map_err(|e| format!("POST {url}: {e}"))?;
    let status = resp.status();
    let bytes = resp.bytes().await.map_err(|e| format!("POST {url}: {e}"))?;
    if !status.is_success() {
        return Err(format!("POST {url}: {status}: {}", String::from_utf8_lossy(&bytes)));
    }
    Ok(bytes.to_vec())
}

impl RemoteEngine {
    /// A client for the server at `url`; `model` is sent as the request's model name and
    /// `api_key` as a bearer token.
    pub fn new(url: &str, model: Option<String>, api_key: Option<String>) -> Result<Self, String> {
        let base = base_url(url)?;
        // The key goes on every request the client sends (marked sensitive: never logged).
        let mut headers = reqwest::header::HeaderMap::new();
        if let Some(k) = api_key {
            let mut v = reqwest::header::HeaderValue::from_str(&format!("Bearer {k}"))
                .map_err(|_| "the API key holds characters an HTTP header cannot carry".to_string())?;
            v.set_sensitive(true);
            headers.insert(reqwest::header::AUTHORIZATION, v);
        }
        let client = reqwest::Client::builder()
            .default_headers(headers)
            .timeout(Duration::from_secs(600))
            .build()
            .map_err(|e| format!("HTTP client: {e}"))?;
        Ok(RemoteEngine {
            client,
            base,
            model,
            tasks: JoinSet::new(),
            sent: HashMap::new(),
            next_id: 0,
            version: 0,
        })
    }

    /// The server's base URL.
    pub fn base(&self) -> &str {
        &self.base
    }

    /// The version the server serves, as far as this stage knows.
    pub fn version(&self) -> u32 {
        self.version
    }

    /// Requests in flight (retries waiting for their backoff included).
    pub fn in_flight(&self) -> usize {
        self.sent.len()
    }

    /// Sends one sample's request ([`Request::for_sample`]) and returns its id; its
    /// [`Output`] comes back from [`Self::next`]. Parameters the engine cannot honour are
    /// refused here, naming them.
    pub fn submit(&mut self, prompt: Vec<u32>, params: SamplingParams) -> Result<u64, String> {
        let problems = params.problems();
        if !problems.is_empty() {
            return Err(problems.join("; "));
        }
        let id = self.next_id;
        self.next_id += 1;
        self.send(id, &prompt, &params, Duration::ZERO);
        self.sent.insert(id, (prompt, params, 1));
        Ok(id)
    }

    /// Posts request `id` after `delay`.
    fn send(&mut self, id: u64, prompt: &[u32], params: &SamplingParams, delay: Duration) {
        let body = Request::for_sample(prompt, params, self.model.as_deref());
        let (client, url) = (self.client.clone(), format!("{}/v1/completions", self.base));
        let (params, version, prompt_len) = (params.clone(), self.version, prompt.len());
        self.tasks.spawn(async move {
            tokio::time::sleep(delay).await;
            let started = now_ms();
            let r = match post_json(&client, &url, &body).await {
                Ok(bytes) => read_answer(&url, &bytes, id, prompt_len, &params, version),
                Err(e) => Err(e),
            };
            let r = r.map(|mut o| {
                (o.queued_at, o.started_at, o.finished_at) = (started, started, now_ms());
                o
            });
            (id, r)
        });
    }

    /// The next finished request (waits up to `wait`; `None`: nothing finished in time
    /// or nothing in flight). A failed request is retried (its error logged) until its
    /// [`ATTEMPTS`]-th failure, which is returned.
    pub async fn next(&mut self, wait: Duration) -> Option<Result<Output, String>> {
        let deadline = tokio::time::Instant::now() + wait;
        loop {
            if self.tasks.is_empty() {
                return None;
            }
            let (id, r) = match tokio::time::timeout_at(deadline, self.tasks.join_next()).await {
                Ok(Some(Ok(r))) => r,
                Ok(Some(Err(e))) => return Some(Err(format!("engine {}: request task failed: {e}", self.base))),
                _ => return None,
            };
            let Some((prompt, params, attempts)) = self.sent.remove(&id) else {
                continue;
            };
            match r {
                Ok(o) => return Some(Ok(o)),
                Err(e) if attempts >= ATTEMPTS => {
                    return Some(Err(format!(
                        "engine {}: a request failed {attempts} times; last error: {e}",
                        self.base
                    )));
                }
                Err(e) => {
                    tracing::warn!(engine = %self.base, attempt = attempts, error = %e, "remote request failed; retrying");
                    self.send(id, &prompt, &params, Duration::from_millis(100 << attempts.min(5)));
                    self.sent.insert(id, (prompt, params, attempts + 1));
                }
            }
        }
    }

    /// Pushes a new policy version to the server (`POST /v1/load_weights`): `location` is a
    /// checkpoint directory the server can read or an `http://` checkpoint URL it fetches.
    pub async fn load_weights(&mut self, location: &str, version: u32, sha256: &str) -> Result<(), String> {
        let url = format!("{}/v1/load_weights", self.base);
        let body = LoadWeights {
            path: Some(location.to_string()),
            version: Some(version),
            sha256: Some(sha256.to_string()),
        };
        post_json(&self.client, &url, &body).await?;
        self.version = version;
        Ok(())
    }

    /// Records the version the server serves when weights are synced some other way.
    pub fn set_version(&mut self, version: u32) {
        self.version = version;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn urls_parse() {
        assert_eq!(base_url("openai://127.0.0.1:8000").unwrap(), "http://127.0.0.1:8000");
        assert_eq!(base_url("http://gpu-3:8000/").unwrap(), "http://gpu-3:8000");
        assert!(base_url("kafka://x:1").unwrap_err().contains("expected openai://"));
        assert!(base_url("openai://nohost").unwrap_err().contains("host:port"));
    }

    #[test]
    fn answers_that_are_not_completions_are_named() {
        let p = SamplingParams::default();
        let e = read_answer("u", b"{\"error\": 1}", 1, 1, &p, 0).unwrap_err();
        assert!(e.contains("not a completion") && e.contains("{\"error\": 1}"), "{e}");
        let empty = br#"{"id": "x", "object": "text_completion", "created": 0, "model": "m", "choices": []}"#;
        assert!(read_answer("u", empty, 1, 1, &p, 0).unwrap_err().contains("no choices"));
    }

    /// A server that answers 503 to the first `failures` requests, then a completion of
    /// two tokens; returns its URL and the count of requests it saw.
    async fn flaky(failures: usize) -> (String, std::sync::Arc<std::sync::atomic::AtomicUsize>) {
        use std::sync::atomic::{AtomicUsize, Ordering};
        let seen = std::sync::Arc::new(AtomicUsize::new(0));
        let count = seen.clone();
        let app = axum::Router::new().route(
            "/v1/completions",
            axum::routing::post(move || {
                let n = count.fetch_add(1, Ordering::SeqCst);
                async move {
                    if n < failures {
                        return (axum::http::StatusCode::SERVICE_UNAVAILABLE, "warming up".to_string());
                    }
                    let body = r#"{"id": "c", "object": "text_completion", "created": 0, "model": "m", "choices": [
                        {"index": 0, "text": "ab", "finish_reason": "length",
                         "logprobs": {"tokens": ["token_id:3", "token_id:4"], "token_logprobs": [-0.5, -0.25]}}]}"#;
                    (axum::http::StatusCode::OK, body.to_string())
                }
            }),
        );
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        tokio::spawn(async move { axum::serve(listener, app).await });
        (format!("openai://{addr}"), seen)
    }

    #[tokio::test]
    async fn failed_requests_are_retried_then_reported() {
        use std::sync::atomic::Ordering;
        let params = SamplingParams {
            max_tokens: 2,
            ..Default::default()
        };
        // Two failures, then an answer: the caller sees only the answer.
        let (url, seen) = flaky(2).await;
        let mut e = RemoteEngine::new(&url, None, None).unwrap();
        let id = e.submit(vec![1, 2], params.clone()).unwrap();
        let o = e.next(Duration::from_secs(30)).await.unwrap().unwrap();
        assert_eq!((o.id, o.tokens, e.in_flight()), (id, vec![3, 4], 0));
        assert_eq!(seen.load(Ordering::SeqCst), 3);
        // A server that never answers well: the error after the last attempt, naming it.
        let (url, seen) = flaky(usize::MAX).await;
        let mut e = RemoteEngine::new(&url, None, None).unwrap();
        e.submit(vec![1], params.clone()).unwrap();
        let err = e.next(Duration::from_secs(30)).await.unwrap().unwrap_err();
        assert!(
            err.contains(&format!("failed {ATTEMPTS} times")) && err.contains("warming up"),
            "{err}"
        );
        assert_eq!(seen.load(Ordering::SeqCst), ATTEMPTS as usize);
        assert!(e.next(Duration::from_millis(10)).await.is_none());
        // Parameters the engine cannot honour never leave the stage.
        let bad = SamplingParams { top_p: 0.0, ..params };
        assert!(e.submit(vec![1], bad).is_err());
    }
}
