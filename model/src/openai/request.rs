//! The request body of `/v1/completions` and `/v1/chat/completions`, typed: what
//! `streamrl serve` reads and what the rollout stage's remote engine sends. Every field has
//! the type the OpenAI API gives it, so a wrongly typed value (`"stream": "yes"`, `"top_logprobs": -1`,
//! `"max_tokens": 1e300`) is a 400 that names the field ([`parse`]), and [`Request::check`]
//! then reports every out-of-range value at once. Fields of vLLM's API that streamrl
//! implements are read too; fields that would change the output and that streamrl does
//! not implement (penalties, `logit_bias`, `tools`, `best_of`, …) are refused rather than
//! ignored. Unknown fields are ignored, as OpenAI's servers do.

use std::collections::HashMap;

use serde::{Deserialize, Serialize};
use serde_json::Value;

use crate::engine::{MAX_TOP_LOGPROBS, SamplingParams};

/// A problem with one field of a request: its path is the answer's `param`.
pub use streamrl_schemas::Problem;

/// `stream_options`.
#[derive(Debug, Default, Clone, PartialEq, Deserialize, Serialize)]
#[serde(default)]
pub struct StreamOptions {
    /// Send a last chunk with the request's token usage (and `"usage": null` before).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub include_usage: Option<bool>,
}

/// `logprobs`: a boolean in the chat API, a count of alternatives in the completions API.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
#[serde(untagged)]
pub enum Logprobs {
    /// `true` / `false`.
    Flag(bool),
    /// The number of most likely alternatives per token.
    Count(u64),
}

impl<'de> Deserialize<'de> for Logprobs {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl serde::de::Visitor<'_> for V {
            type Value = Logprobs;
            fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
                f.write_str("a boolean or a non-negative integer")
            }
            fn visit_bool<E: serde::de::Error>(self, v: bool) -> Result<Logprobs, E> {
                Ok(Logprobs::Flag(v))
            }
            fn visit_u64<E: serde::de::Error>(self, v: u64) -> Result<Logprobs, E> {
                Ok(Logprobs::Count(v))
            }
        }
        d.deserialize_any(V)
    }
}

/// A seed: any signed or unsigned 64-bit integer (a negative one is taken modulo 2^64).
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
#[serde(transparent)]
pub struct Seed(pub u64);

impl<'de> Deserialize<'de> for Seed {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl serde::de::Visitor<'_> for V {
            type Value = Seed;
            fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
                f.write_str("a 64-bit integer")
            }
            fn visit_u64<E: serde::de::Error>(self, v: u64) -> Result<Seed, E> {
                Ok(Seed(v))
            }
            fn visit_i64<E: serde::de::Error>(self, v: i64) -> Result<Seed, E> {
                Ok(Seed(v as u64))
            }
        }
        d.deserialize_any(V)
    }
}

/// A chat message's content: a string or a list of parts.
#[derive(Debug, Clone, PartialEq, Deserialize, Serialize)]
#[serde(untagged)]
pub enum Content {
    /// Plain text.
    Text(String),
    /// Content parts (only `text` parts are supported).
    Parts(Vec<Part>),
}

/// One content part.
#[derive(Debug, Clone, PartialEq, Deserialize, Serialize)]
pub struct Part {
    /// `text` (others, such as `image_url`, are refused).
    #[serde(rename = "type")]
    pub kind: String,
    /// The text of a `text` part.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub text: Option<String>,
}

/// One chat message.
#[derive(Debug, Clone, PartialEq, Deserialize, Serialize)]
pub struct Message {
    /// `system`, `user`, `assistant`, `tool`, …
    pub role: String,
    /// Text or text parts (`null` is an empty message).
    #[serde(default)]
    pub content: Option<Content>,
}

/// Both endpoints' request body (`prompt` for completions, `messages` for chat). Fields
/// left `None` are not sent.
#[serde_with::skip_serializing_none]
#[derive(Debug, Default, Clone, PartialEq, Deserialize, Serialize)]
#[serde(default)]
pub struct Request {
    /// Must be the served model's name when given.
    pub model: Option<String>,
    /// Completions: a string, a list of token ids, or a list holding one of those.
    pub prompt: Option<Value>,
    /// Chat: the conversation.
    pub messages: Option<Vec<Message>>,
    /// Choices per request (1..=128).
    pub n: Option<u64>,
    /// Sampling temperature (0..=2; 0 is greedy).
    pub temperature: Option<f64>,
    /// Nucleus mass in (0, 1].
    pub top_p: Option<f64>,
    /// Keep the k most likely tokens (vLLM; 0 or -1: off).
    pub top_k: Option<i64>,
    /// New tokens at most.
    pub max_tokens: Option<u64>,
    /// The chat API's newer name for `max_tokens`.
    pub max_completion_tokens: Option<u64>,
    /// A stop string or a list of them.
    pub stop: Option<Stop>,
    /// Token ids that end a choice (vLLM).
    pub stop_token_ids: Option<Vec<u32>>,
    /// RNG seed (any 64-bit integer, signed or not).
    pub seed: Option<Seed>,
    /// Server-sent events.
    pub stream: Option<bool>,
    /// Streaming options.
    pub stream_options: Option<StreamOptions>,
    /// Chat: `true` for logprobs; completions: the number of alternatives per token.
    pub logprobs: Option<Logprobs>,
    /// Chat: alternatives per token (0..=20, needs `logprobs: true`).
    pub top_logprobs: Option<u64>,
    /// Completions: the prompt is part of the answer's text (and of its logprobs).
    pub echo: Option<bool>,
    /// Keep generating past end-of-sequence (vLLM).
    pub ignore_eos: Option<bool>,
    /// Keep the stop string in the text (vLLM; finish reason `tool_calls` in chat).
    pub include_stop_str_in_output: Option<bool>,
    /// Logprob tokens as `token_id:N` (vLLM); streamrl adds `policy_versions`.
    pub return_tokens_as_token_ids: Option<bool>,
    /// Accepted for vLLM clients; special tokens are never removed from streamrl's text.
    pub skip_special_tokens: Option<bool>,
    /// Not implemented: refused unless 0.
    pub presence_penalty: Option<f64>,
    /// Not implemented: refused unless 0.
    pub frequency_penalty: Option<f64>,
    /// Not implemented: refused unless 1.
    pub repetition_penalty: Option<f64>,
    /// Not implemented: refused unless empty.
    pub logit_bias: Option<HashMap<String, f64>>,
    /// Not implemented: refused unless empty.
    pub tools: Option<Vec<Value>>,
    /// Only `{"type": "text"}`.
    pub response_format: Option<Value>,
    /// Not implemented: refused unless 1 or n.
    pub best_of: Option<u64>,
    /// Not implemented: refused unless empty.
    pub suffix: Option<String>,
    /// Accepted and ignored.
    pub user: Option<String>,
}

/// `stop`: one string or a list.
#[derive(Debug, Clone, PartialEq, Deserialize, Serialize)]
#[serde(untagged)]
pub enum Stop {
    /// One stop string.
    One(String),
    /// Several.
    Many(Vec<String>),
}

/// Parses a request body (a JSON object) as `T`; a problem names the field that has the
/// wrong type.
pub fn parse<T: serde::de::DeserializeOwned>(body: &[u8]) -> Result<T, Problem> {
    let v: Value =
        serde_json::from_slice(body).map_err(|e| Problem::new("", format!("the body is not valid JSON: {e}")))?;
    if !v.is_object() {
        return Err(Problem::new("", "the body must be a JSON object"));
    }
    serde_path_to_error::deserialize(v).map_err(|e| {
        let param = e.path().to_string();
        let param = param.trim_start_matches('.').to_string();
        let inner = e.into_inner().to_string();
        let inner = match param.as_str() {
            "stop" => "expected a string or a list of strings".to_string(),
            p if p.starts_with("messages") && p.ends_with("content") => {
                "expected a string, a list of content parts or null".to_string()
            }
            _ => inner,
        };
        Problem::new(param.clone(), format!("`{param}`: {inner}"))
    })
}

/// What a valid request asks for, endpoint-independent.
#[derive(Debug, Clone, PartialEq)]
pub struct Checked {
    /// Choices.
    pub n: usize,
    /// Temperature.
    pub temperature: f32,
    /// Nucleus mass.
    pub top_p: f32,
    /// Top-k (0: off).
    pub top_k: usize,
    /// New tokens (0 only with `echo`: the prompt is scored, nothing is generated).
    pub max_tokens: usize,
    /// Stop strings.
    pub stop: Vec<String>,
    /// Keep stop strings in the text.
    pub keep_stop: bool,
    /// Stop token ids.
    pub stop_token_ids: Vec<u32>,
    /// Seed (random when not given).
    pub seed: Option<u64>,
    /// Server-sent events.
    pub stream: bool,
    /// A last usage chunk when streaming.
    pub include_usage: bool,
    /// Logprobs with this many alternatives per token; `None`: no logprobs.
    pub logprobs: Option<usize>,
    /// Completions: the prompt is echoed.
    pub echo: bool,
    /// Do not stop at end-of-sequence.
    pub ignore_eos: bool,
    /// `token_id:N` tokens.
    pub token_ids: bool,
}

impl Request {
    /// Every out-of-range or unsupported value (`chat`: the chat endpoint's rules).
    /// `max_tokens` defaults to `default_max`; `prompt_len` + `max_tokens` must fit
    /// `context`.
    pub fn check(
        &self,
        chat: bool,
        prompt_len: usize,
        context: usize,
        default_max: usize,
    ) -> Result<Checked, Vec<Problem>> {
        let mut p = Vec::new();
        let (n, temperature, top_p, top_k) = self.sampling(&mut p);
        let echo = self.echo.unwrap_or(false);
        if chat && self.echo.is_some() {
            p.push(Problem::new("echo", "`echo` is a completions parameter"));
        }
        let max = self.max_new_tokens(echo, prompt_len, context, default_max, &mut p);
        let stop = match &self.stop {
            None => vec![],
            Some(Stop::One(s)) => vec![s.clone()],
            Some(Stop::Many(v)) => v.clone(),
        };
        if stop.iter().any(String::is_empty) {
            p.push(Problem::new("stop", "stop strings must not be empty"));
        }
        let logprobs = self.logprobs(chat, &mut p);
        self.unsupported(n, &mut p);
        let stream = self.stream.unwrap_or(false);
        if self.stream_options.is_some() && !stream {
            p.push(Problem::new("stream_options", "`stream_options` needs `stream: true`"));
        }
        if !p.is_empty() {
            return Err(p);
        }
        Ok(Checked {
            n: n as usize,
            temperature: temperature as f32,
            top_p: top_p as f32,
            top_k,
            max_tokens: max as usize,
            stop,
            keep_stop: self.include_stop_str_in_output.unwrap_or(false),
            stop_token_ids: self.stop_token_ids.clone().unwrap_or_default(),
            seed: self.seed.map(|s| s.0),
            stream,
            include_usage: self
                .stream_options
                .as_ref()
                .and_then(|o| o.include_usage)
                .unwrap_or(false),
            logprobs: logprobs.map(|k| k as usize),
            echo,
            ignore_eos: self.ignore_eos.unwrap_or(false),
            token_ids: self.return_tokens_as_token_ids.unwrap_or(false),
        })
    }

    /// `n`, `temperature`, `top_p` and `top_k` (0: off), each checked.
    fn sampling(&self, p: &mut Vec<Problem>) -> (u64, f64, f64, usize) {
        let n = self.n.unwrap_or(1);
        if !(1..=128).contains(&n) {
            p.push(Problem::new("n", format!("`n` must be in 1..=128, got {n}")));
        }
        let temperature = self.temperature.unwrap_or(1.0);
        if !(0.0..=2.0).contains(&temperature) {
            p.push(Problem::new(
                "temperature",
                format!("`temperature` must be in [0, 2], got {temperature}"),
            ));
        }
        let top_p = self.top_p.unwrap_or(1.0);
        if !(top_p > 0.0 && top_p <= 1.0) {
            p.push(Problem::new("top_p", format!("`top_p` must be in (0, 1], got {top_p}")));
        }
        let top_k = match self.top_k {
            None | Some(-1) | Some(0) => 0,
            Some(k) if k > 0 => k as usize,
            Some(k) => {
                p.push(Problem::new(
                    "top_k",
                    format!("`top_k` must be -1, 0 (off) or positive, got {k}"),
                ));
                0
            }
        };
        (n, temperature, top_p, top_k)
    }

    /// The most new tokens (`max_completion_tokens`, else `max_tokens`, else `default_max`),
    /// checked against the context.
    fn max_new_tokens(
        &self,
        echo: bool,
        prompt_len: usize,
        context: usize,
        default_max: usize,
        p: &mut Vec<Problem>,
    ) -> u64 {
        let (max_param, max) = match (self.max_completion_tokens, self.max_tokens) {
            (Some(m), _) => ("max_completion_tokens", m),
            (None, Some(m)) => ("max_tokens", m),
            (None, None) => ("max_tokens", default_max as u64),
        };
        if max == 0 && !echo {
            p.push(Problem::new(
                max_param,
                format!("`{max_param}` must be at least 1 (0 only with `echo`, to score the prompt)"),
            ));
        }
        if (prompt_len as u64).saturating_add(max) > context as u64 {
            p.push(Problem::new(
                max_param,
                format!(
                    "This model's maximum context length is {context} tokens; the prompt has {prompt_len} and `{max_param}` is {max}"
                ),
            ));
        }
        max
    }

    /// How many alternatives to report per token (`None`: no logprobs), read the chat way
    /// (`logprobs: true` + `top_logprobs`) or the completions way (`logprobs: N`).
    fn logprobs(&self, chat: bool, p: &mut Vec<Problem>) -> Option<u64> {
        let logprobs = match (chat, self.logprobs, self.top_logprobs) {
            (true, Some(Logprobs::Count(_)), _) => {
                p.push(Problem::new(
                    "logprobs",
                    "`logprobs` is a boolean in the chat API (use `top_logprobs` for alternatives)",
                ));
                None
            }
            (true, Some(Logprobs::Flag(true)), top) => Some(top.unwrap_or(0)),
            (true, _, Some(_)) => {
                p.push(Problem::new("top_logprobs", "`top_logprobs` needs `logprobs: true`"));
                None
            }
            (true, _, None) => None,
            (false, _, Some(_)) => {
                p.push(Problem::new(
                    "top_logprobs",
                    "`top_logprobs` is a chat parameter (completions take `logprobs: N`)",
                ));
                None
            }
            (false, Some(Logprobs::Count(k)), None) => Some(k),
            (false, Some(Logprobs::Flag(true)), None) => Some(0),
            (false, _, None) => None,
        };
        let param = if chat { "top_logprobs" } else { "logprobs" };
        if let Some(k) = logprobs.filter(|k| *k > MAX_TOP_LOGPROBS as u64) {
            p.push(Problem::new(
                param,
                format!("`{param}` must be at most {MAX_TOP_LOGPROBS}, got {k}"),
            ));
        }
        logprobs
    }

    /// Parameters streamrl refuses rather than ignores.
    fn unsupported(&self, n: u64, p: &mut Vec<Problem>) {
        for (param, value, neutral) in [
            ("presence_penalty", self.presence_penalty, 0.0),
            ("frequency_penalty", self.frequency_penalty, 0.0),
            ("repetition_penalty", self.repetition_penalty, 1.0),
        ] {
            if let Some(v) = value.filter(|v| *v != neutral) {
                p.push(Problem::new(
                    param,
                    format!("`{param}` {v} is not supported (only {neutral})"),
                ));
            }
        }
        if self.logit_bias.as_ref().is_some_and(|b| !b.is_empty()) {
            p.push(Problem::new("logit_bias", "`logit_bias` is not supported"));
        }
        if self.tools.as_ref().is_some_and(|t| !t.is_empty()) {
            p.push(Problem::new(
                "tools",
                "`tools` is not supported (tool calls are text the environment parses)",
            ));
        }
        match &self.response_format {
            None | Some(Value::Null) => {}
            Some(f) if f.get("type").and_then(Value::as_str) == Some("text") => {}
            Some(f) => p.push(Problem::new(
                "response_format",
                format!("`response_format` {f} is not supported (only {{\"type\": \"text\"}})"),
            )),
        }
        if let Some(b) = self.best_of.filter(|b| *b != 1 && *b != n) {
            p.push(Problem::new(
                "best_of",
                format!("`best_of` {b} is not supported (only 1 or n)"),
            ));
        }
        if self.suffix.as_ref().is_some_and(|s| !s.is_empty()) {
            p.push(Problem::new("suffix", "`suffix` is not supported"));
        }
    }

    /// The completions prompt as token ids: a string is encoded with `encode`; token ids
    /// must be below `vocab`.
    pub fn prompt_ids(
        &self,
        vocab: usize,
        encode: impl Fn(&str) -> Result<Vec<u32>, String>,
    ) -> Result<Vec<u32>, Problem> {
        let bad = |m: String| Problem::new("prompt", m);
        let ids = |a: &[Value]| -> Result<Vec<u32>, Problem> {
            a.iter()
                .enumerate()
                .map(|(i, x)| match x.as_u64() {
                    Some(t) if t < vocab as u64 => Ok(t as u32),
                    Some(t) => Err(bad(format!(
                        "prompt token {t} at index {i} is outside the vocabulary of {vocab}"
                    ))),
                    None => Err(bad(format!(
                        "prompt[{i}] = {x} is not a token id (a non-negative integer)"
                    ))),
                })
                .collect()
        };
        let out = match &self.prompt {
            None | Some(Value::Null) => return Err(bad("`prompt` is required".into())),
            Some(Value::String(s)) => encode(s).map_err(bad)?,
            Some(Value::Array(a)) if a.len() == 1 && a[0].is_string() => {
                encode(a[0].as_str().unwrap_or_default()).map_err(bad)?
            }
            Some(Value::Array(a)) if a.len() == 1 && a[0].is_array() => {
                ids(a[0].as_array().map_or(&[][..], Vec::as_slice))?
            }
            Some(Value::Array(a)) if a.len() > 1 && (a[0].is_string() || a[0].is_array()) => {
                return Err(bad(format!(
                    "{} prompts in one request: send one prompt per request (use `n` for several choices)",
                    a.len()
                )));
            }
            Some(Value::Array(a)) => ids(a)?,
            Some(v) => {
                return Err(bad(format!(
                    "`prompt` must be a string or a list of token ids, got {v}"
                )));
            }
        };
        if out.is_empty() {
            return Err(bad("the prompt is empty".into()));
        }
        Ok(out)
    }

    /// The chat messages as (role, text).
    pub fn chat_messages(&self) -> Result<Vec<(String, String)>, Problem> {
        let Some(ms) = self.messages.as_ref().filter(|m| !m.is_empty()) else {
            return Err(Problem::new("messages", "`messages` must be a non-empty list"));
        };
        ms.iter()
            .enumerate()
            .map(|(i, m)| {
                let text = match &m.content {
                    None => String::new(),
                    Some(Content::Text(t)) => t.clone(),
                    Some(Content::Parts(parts)) => {
                        let mut t = String::new();
                        for (j, part) in parts.iter().enumerate() {
                            match (part.kind.as_str(), &part.text) {
                                ("text", Some(x)) => t.push_str(x),
                                (kind, _) => {
                                    return Err(Problem::new(
                                        format!("messages[{i}].content[{j}]"),
                                        format!("content part of type `{kind}` is not supported (only `text` parts with a `text`)"),
                                    ));
                                }
                            }
                        }
                        t
                    }
                };
                Ok((m.role.clone(), text))
            })
            .collect()
    }
}

impl Checked {
    /// Choice `index`'s sampling parameters: a given seed is offset by the choice's index
    /// (choices differ, requests repeat), a missing one is random. vLLM's
    /// `include_stop_str_in_output` keeps the stop string in the text: the engine's
    /// tool-call stops do exactly that.
    pub fn sampling(&self, index: usize) -> SamplingParams {
        let (stop, kept) = if self.keep_stop {
            (vec![], self.stop.clone())
        } else {
            (self.stop.clone(), vec![])
        };
        SamplingParams {
            temperature: self.temperature,
            top_p: self.top_p,
            top_k: self.top_k,
            seed: self.seed.map_or_else(rand::random, |s| s.wrapping_add(index as u64)),
            max_tokens: self.max_tokens,
            stop,
            tool_call_stop: kept,
            stop_token_ids: self.stop_token_ids.clone(),
            ignore_eos: self.ignore_eos,
            logprobs: self.logprobs.unwrap_or(0),
        }
    }
}

impl Request {
    /// The `/v1/completions` request for one sample of an RL rollout: the prompt as token
    /// ids, the sample's seed, `logprobs: 1` with vLLM's `return_tokens_as_token_ids` so
    /// token ids and their logprobs come back exactly, special tokens kept, and the
    /// tool-call markers as stop strings kept in the text (`include_stop_str_in_output`),
    /// so a turn that ends in a call keeps its marker.
    pub fn for_sample(prompt: &[u32], params: &SamplingParams, model: Option<&str>) -> Request {
        let mut stops = params.stop.clone();
        stops.extend(params.tool_call_stop.iter().cloned());
        Request {
            model: model.map(str::to_string),
            prompt: Some(Value::from(prompt.to_vec())),
            max_tokens: Some(params.max_tokens as u64),
            temperature: Some(params.temperature as f64),
            top_p: Some(params.top_p as f64),
            top_k: (params.top_k > 0).then_some(params.top_k as i64),
            seed: Some(Seed(params.seed)),
            logprobs: Some(Logprobs::Count(1)),
            return_tokens_as_token_ids: Some(true),
            include_stop_str_in_output: Some(true),
            skip_special_tokens: Some(false),
            stop: Some(Stop::Many(stops)),
            ignore_eos: params.ignore_eos.then_some(true),
            ..Request::default()
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn err(body: &str) -> Problem {
        parse::<Request>(body.as_bytes()).unwrap_err()
    }

    fn check(body: &str, chat: bool) -> Result<Checked, Vec<Problem>> {
        parse::<Request>(body.as_bytes()).unwrap().check(chat, 5, 128, 16)
    }

    #[test]
    fn wrongly_typed_fields_name_the_field() {
        for (body, param) in [
            (r#"{"model": 123}"#, "model"),
            (r#"{"stream": "yes"}"#, "stream"),
            (r#"{"logprobs": "yes"}"#, "logprobs"),
            (r#"{"top_logprobs": -1}"#, "top_logprobs"),
            (r#"{"max_tokens": 1e300}"#, "max_tokens"),
            (r#"{"max_tokens": 18446744073709551616}"#, "max_tokens"),
            (r#"{"max_tokens": -1}"#, "max_tokens"),
            (r#"{"n": 1.5}"#, "n"),
            (r#"{"stop": 7}"#, "stop"),
            (r#"{"seed": 1.5}"#, "seed"),
            (
                r#"{"stream_options": {"include_usage": 1}}"#,
                "stream_options.include_usage",
            ),
            (r#"{"messages": [{"role": 1, "content": "x"}]}"#, "messages[0].role"),
            (
                r#"{"messages": [{"role": "user", "content": 5}]}"#,
                "messages[0].content",
            ),
        ] {
            let p = err(body);
            assert_eq!(p.path, param, "{body}: {p:?}");
            assert!(p.message.contains(&format!("`{param}`")), "{p:?}");
        }
        assert!(err("{not json").message.contains("not valid JSON"));
        assert!(err("[1]").message.contains("JSON object"));
    }

    #[test]
    fn every_out_of_range_value_is_reported_at_once() {
        let e = check(
            r#"{"n": 0, "temperature": 3, "top_p": 0, "max_tokens": 1000, "top_logprobs": 2,
                "presence_penalty": 0.5, "logit_bias": {"5": 1}, "tools": [{}], "stream_options": {}}"#,
            true,
        )
        .unwrap_err();
        let params: Vec<&str> = e.iter().map(|p| p.path.as_str()).collect();
        assert_eq!(
            params,
            [
                "n",
                "temperature",
                "top_p",
                "max_tokens",
                "top_logprobs",
                "presence_penalty",
                "logit_bias",
                "tools",
                "stream_options"
            ]
        );
        // The context check cannot wrap.
        let e = check(r#"{"max_tokens": 18446744073709551615}"#, false).unwrap_err();
        assert!(e[0].message.contains("maximum context length is 128"), "{e:?}");
        let e = check(r#"{"logprobs": 21}"#, false).unwrap_err();
        assert_eq!(e[0].path, "logprobs");
        let e = check(r#"{"logprobs": 3}"#, true).unwrap_err();
        assert!(e[0].message.contains("boolean in the chat API"), "{e:?}");
        assert_eq!(check(r#"{"max_tokens": 0}"#, false).unwrap_err()[0].path, "max_tokens");
    }

    #[test]
    fn valid_requests_read_as_expected() {
        let c = check(
            r#"{"logprobs": true, "top_logprobs": 3, "stream": true, "stream_options": {"include_usage": true},
                "seed": -1, "stop": "\n", "max_completion_tokens": 7, "presence_penalty": 0}"#,
            true,
        )
        .unwrap();
        assert_eq!(
            (c.logprobs, c.stream, c.include_usage, c.seed, c.stop, c.max_tokens),
            (Some(3), true, true, Some(u64::MAX), vec!["\n".to_string()], 7)
        );
        let c = check(r#"{"echo": true, "max_tokens": 0, "logprobs": 0}"#, false).unwrap();
        assert_eq!((c.echo, c.max_tokens, c.logprobs), (true, 0, Some(0)));
        let vocab = |r: &str| {
            parse::<Request>(r.as_bytes())
                .unwrap()
                .prompt_ids(64, |s| Ok(vec![s.len() as u32]))
        };
        assert_eq!(vocab(r#"{"prompt": [1, 2, 3]}"#).unwrap(), [1, 2, 3]);
        assert_eq!(vocab(r#"{"prompt": [[4]]}"#).unwrap(), [4]);
        assert_eq!(vocab(r#"{"prompt": ["abc"]}"#).unwrap(), [3]);
        assert!(
            vocab(r#"{"prompt": [1, 4294967296]}"#)
                .unwrap_err()
                .message
                .contains("4294967296 at index 1")
        );
        assert!(
            vocab(r#"{"prompt": [64]}"#)
                .unwrap_err()
                .message
                .contains("vocabulary of 64")
        );
        assert!(
            vocab(r#"{"prompt": [1.5]}"#)
                .unwrap_err()
                .message
                .contains("not a token id")
        );
        assert!(
            vocab(r#"{"prompt": ["a", "b"]}"#)
                .unwrap_err()
                .message
                .contains("2 prompts")
        );
        assert!(vocab(r#"{"prompt": []}"#).unwrap_err().message.contains("empty"));
    }
}
