//! A remote OpenAI-compatible server as the rollout stage's engine
//! (`engine: openai://host:port`): `streamrl serve`, or vLLM / SGLang.
//!
//! Each sample is one `POST /v1/completions` with the prompt as token ids, the sample's
//! seed, `logprobs: 1` and vLLM's `return_tokens_as_token_ids`, so completion token ids and
//! their logprobs come back exactly. Tool-call markers are sent as stop strings with
//! `include_stop_str_in_output`, so a turn that ends in a call keeps its marker and is
//! reported as `tool_call`. `streamrl serve` also returns each token's policy version
//! (`policy_versions`); for other servers every token gets the version last pushed.
//!
//! Weight updates: with `sync_weights`, each new policy version is sent to
//! `POST /v1/load_weights {path, version, sha256}` (streamrl serve: an in-flight update
//! between two decode steps; the checkpoint path must be readable by the server). Other
//! servers need their own weight sync; turn `sync_weights` off for them.

use std::time::Duration;

use serde_json::{Value, json};
use streamrl_model::engine::{FinishReason, Output, SamplingParams};
use tokio::task::JoinSet;

use crate::now_ms;

/// The rollout stage's remote engine.
#[derive(Debug)]
pub struct RemoteEngine {
    client: reqwest::Client,
    base: String,
    model: Option<String>,
    tasks: JoinSet<(u64, Result<Output, String>)>,
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

fn finish(reason: &str, text: &str, tool_stops: &[String]) -> FinishReason {
    match reason {
        "length" => FinishReason::Length,
        _ if tool_stops.iter().any(|m| text.ends_with(m.as_str())) => FinishReason::ToolCall,
        _ => FinishReason::Stop,
    }
}

/// Parses one completion choice: token ids from `token_id:N` logprob tokens, their
/// logprobs, versions when the server reports them.
fn parse_choice(
    id: u64,
    prompt_len: usize,
    c: &Value,
    stops: &[String],
    tool_stops: &[String],
    version: u32,
    started: i64,
) -> Result<Output, String> {
    let lp = c
        .get("logprobs")
        .filter(|l| !l.is_null())
        .ok_or("the server returned no logprobs")?;
    let tokens: Vec<u32> = lp
        .get("tokens")
        .and_then(Value::as_array)
        .ok_or("logprobs.tokens is missing")?
        .iter()
        .map(|t| {
            t.as_str()
                .and_then(|s| s.strip_prefix("token_id:"))
                .and_then(|n| n.parse().ok())
                .ok_or_else(|| {
                    format!("token {t} is not `token_id:N`: the server must support return_tokens_as_token_ids")
                })
        })
        .collect::<Result<_, _>>()?;
    let logprobs: Vec<f32> = lp
        .get("token_logprobs")
        .and_then(Value::as_array)
        .ok_or("logprobs.token_logprobs is missing")?
        .iter()
        .map(|x| {
            x.as_f64()
                .map(|v| v as f32)
                .ok_or_else(|| format!("logprob {x} is not a number"))
        })
        .collect::<Result<_, _>>()?;
    if logprobs.len() != tokens.len() {
        return Err(format!("{} tokens but {} logprobs", tokens.len(), logprobs.len()));
    }
    let versions = match c.get("policy_versions").and_then(Value::as_array) {
        Some(v) if v.len() == tokens.len() => v.iter().map(|x| x.as_u64().unwrap_or(version as u64) as u32).collect(),
        _ => vec![version; tokens.len()],
    };
    let mut text = c.get("text").and_then(Value::as_str).unwrap_or_default().to_string();
    let reason = finish(
        c.get("finish_reason").and_then(Value::as_str).unwrap_or("stop"),
        &text,
        tool_stops,
    );
    // Ordinary stop strings stay out of the text, as with the local engine.
    for s in stops {
        if reason == FinishReason::Stop && text.ends_with(s.as_str()) {
            text.truncate(text.len() - s.len());
        }
    }
    Ok(Output {
        id,
        prompt_len,
        top_logprobs: vec![Vec::new(); tokens.len()],
        tokens,
        logprobs,
        versions,
        text,
        finish_reason: reason,
        queued_at: started,
        started_at: started,
        finished_at: now_ms(),
    })
}

/// POSTs a JSON body; the answer's bytes on a 2xx, else an error naming the URL, the
/// status and the server's answer.
async fn post_json(client: &reqwest::Client, url: &str, body: &Value) -> Result<Vec<u8>, String> {
    let resp = client
        .post(url)
        .header("content-type", "application/json")
        .body(body.to_string())
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

    /// Requests in flight.
    pub fn in_flight(&self) -> usize {
        self.tasks.len()
    }

    /// Sends one sample's request; its [`Output`] comes back from [`Self::next`].
    pub fn submit(&mut self, id: u64, prompt: Vec<u32>, params: &SamplingParams) {
        let mut stops = params.stop.clone();
        stops.extend(params.tool_call_stop.iter().cloned());
        let mut body = json!({
            "prompt": prompt,
            "max_tokens": params.max_tokens,
            "temperature": params.temperature,
            "top_p": params.top_p,
            "seed": params.seed,
            "logprobs": 1,
            "return_tokens_as_token_ids": true,
            "include_stop_str_in_output": true,
            "skip_special_tokens": false,
            "stop": stops,
        });
        if let Some(m) = &self.model {
            body["model"] = json!(m);
        }
        if params.top_k > 0 {
            body["top_k"] = json!(params.top_k);
        }
        if params.ignore_eos {
            body["ignore_eos"] = json!(true);
        }
        let (client, url) = (self.client.clone(), format!("{}/v1/completions", self.base));
        let (stop, tool_stops, version) = (params.stop.clone(), params.tool_call_stop.clone(), self.version);
        let prompt_len = prompt.len();
        self.tasks.spawn(async move {
            let started = now_ms();
            let r = async {
                let bytes = post_json(&client, &url, &body).await?;
                let v: Value =
                    serde_json::from_slice(&bytes).map_err(|e| format!("POST {url}: the answer is not JSON: {e}"))?;
                let c = v
                    .get("choices")
                    .and_then(|c| c.get(0))
                    .ok_or_else(|| format!("POST {url}: no choices in {v}"))?;
                parse_choice(id, prompt_len, c, &stop, &tool_stops, version, started)
            }
            .await;
            (id, r)
        });
    }

    /// The next finished request (waits up to `wait`; `None`: nothing finished in time
    /// or nothing in flight).
    pub async fn next(&mut self, wait: Duration) -> Option<(u64, Result<Output, String>)> {
        if self.tasks.is_empty() {
            return None;
        }
        match tokio::time::timeout(wait, self.tasks.join_next()).await {
            Ok(Some(Ok(r))) => Some(r),
            Ok(Some(Err(e))) => Some((u64::MAX, Err(format!("request task failed: {e}")))),
            _ => None,
        }
    }

    /// Pushes a new policy version to the server (`POST /v1/load_weights`): `location` is a
    /// checkpoint directory the server can read or an `http://` checkpoint URL it fetches.
    pub async fn load_weights(&mut self, location: &str, version: u32, sha256: &str) -> Result<(), String> {
        let url = format!("{}/v1/load_weights", self.base);
        let body = json!({"path": location, "version": version, "sha256": sha256});
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
    fn urls_and_choices_parse() {
        assert_eq!(base_url("openai://127.0.0.1:8000").unwrap(), "http://127.0.0.1:8000");
        assert_eq!(base_url("http://gpu-3:8000/").unwrap(), "http://gpu-3:8000");
        assert!(base_url("kafka://x:1").unwrap_err().contains("expected openai://"));
        assert!(base_url("openai://nohost").unwrap_err().contains("host:port"));
        let c = json!({"text": "12</python>", "finish_reason": "stop", "policy_versions": [3, 4, 4],
                       "logprobs": {"tokens": ["token_id:5", "token_id:6", "token_id:7"], "token_logprobs": [-0.1, -0.2, -0.3]}});
        let o = parse_choice(9, 4, &c, &[], &["</python>".into()], 2, 0).unwrap();
        assert_eq!(
            (o.tokens, o.versions, o.finish_reason),
            (vec![5, 6, 7], vec![3, 4, 4], FinishReason::ToolCall)
        );
        let c = json!({"text": "42\n\n", "finish_reason": "stop",
                       "logprobs": {"tokens": ["token_id:1"], "token_logprobs": [-0.5]}});
        let o = parse_choice(9, 4, &c, &["\n\n".into()], &[], 2, 0).unwrap();
        assert_eq!(
            (o.text.as_str(), o.versions, o.finish_reason),
            ("42", vec![2], FinishReason::Stop)
        );
        let bad = json!({"text": "x", "logprobs": {"tokens": ["x"], "token_logprobs": [-1.0]}});
        assert!(
            parse_choice(1, 1, &bad, &[], &[], 0, 0)
                .unwrap_err()
                .contains("return_tokens_as_token_ids")
        );
    }
}
