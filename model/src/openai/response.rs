//! The answer bodies of the OpenAI API as `streamrl serve` writes them and the rollout
//! stage's remote engine reads them (from `streamrl serve`, vLLM or SGLang). Fields a
//! server adds beyond these (vLLM's `system_fingerprint`, `prompt_logprobs`,
//! `stop_reason`, …) are ignored when reading; logprobs are `f64`, as JSON numbers are.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use crate::engine::{FinishReason, Output, SamplingParams};

/// A completion answer or one streamed chunk of it: `C` is [`TextChoice`] for
/// `/v1/completions` (whole and streamed), [`ChatChoice`] for a whole chat answer and
/// [`ChatDelta`] for a chat chunk.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Completion<C> {
    /// `cmpl-…` or `chatcmpl-…`, the same in every chunk of one answer.
    pub id: String,
    /// `text_completion`, `chat.completion` or `chat.completion.chunk`.
    pub object: String,
    /// Unix seconds.
    pub created: u64,
    /// The served model's name.
    pub model: String,
    /// One per choice (a streamed chunk: the choice it advances; none in a usage chunk).
    pub choices: Vec<C>,
    /// Token usage. A streamed chunk with `include_usage` carries `null` (`Some(None)`)
    /// until the last one; absent (`None`) otherwise.
    #[serde(default, skip_serializing_if = "Option::is_none", deserialize_with = "present")]
    pub usage: Option<Option<Usage>>,
}

/// A field that is present, `null` or not: `Some(None)` for `null` (`None` when absent,
/// by `#[serde(default)]`).
fn present<'de, D: serde::Deserializer<'de>, T: Deserialize<'de>>(d: D) -> Result<Option<Option<T>>, D::Error> {
    Option::<T>::deserialize(d).map(Some)
}

/// A whole `/v1/completions` answer, or one of its streamed chunks.
pub type TextCompletion = Completion<TextChoice>;
/// A whole `/v1/chat/completions` answer.
pub type ChatCompletion = Completion<ChatChoice>;
/// One streamed chunk of a chat answer.
pub type ChatChunk = Completion<ChatDelta>;

/// Token counts of a request.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Usage {
    /// Prompt tokens.
    pub prompt_tokens: usize,
    /// Generated tokens over all choices.
    pub completion_tokens: usize,
    /// Their sum.
    pub total_tokens: usize,
}

impl Usage {
    /// Usage of `prompt_tokens` in and `completion_tokens` out.
    pub fn new(prompt_tokens: usize, completion_tokens: usize) -> Self {
        Usage {
            prompt_tokens,
            completion_tokens,
            total_tokens: prompt_tokens + completion_tokens,
        }
    }
}

/// One choice of a completions answer (or the text a streamed chunk adds to it).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TextChoice {
    /// Which choice (0..n).
    pub index: usize,
    /// The text (with `echo`, the prompt's text first).
    pub text: String,
    /// When asked for.
    pub logprobs: Option<TextLogprobs>,
    /// `stop` or `length`; `null` until the choice's last chunk.
    pub finish_reason: Option<String>,
    /// streamrl's extension with `return_tokens_as_token_ids`: the policy version that
    /// sampled each token.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub policy_versions: Option<Vec<u32>>,
}

/// The completions API's logprobs: parallel lists, one entry per token.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct TextLogprobs {
    /// Each token as text, or `token_id:N` with `return_tokens_as_token_ids`.
    pub tokens: Vec<String>,
    /// Each token's logprob (`null` for an echoed prompt's first token).
    pub token_logprobs: Vec<Option<f64>>,
    /// Each position's most likely tokens with their logprobs (the sampled one included).
    #[serde(default)]
    pub top_logprobs: Vec<Option<BTreeMap<String, f64>>>,
    /// Each token's byte offset in the choice's text.
    #[serde(default)]
    pub text_offset: Vec<usize>,
}

/// One choice of a whole chat answer.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ChatChoice {
    /// Which choice (0..n).
    pub index: usize,
    /// The assistant's message.
    pub message: AssistantMessage,
    /// When asked for.
    pub logprobs: Option<ChatLogprobs>,
    /// `stop`, `length` or `tool_calls`.
    pub finish_reason: Option<String>,
}

/// The assistant's answer.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct AssistantMessage {
    /// `assistant`.
    pub role: String,
    /// Its text (`null` from servers that answer with tool calls only).
    pub content: Option<String>,
}

/// One streamed chunk's change to a chat choice.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ChatDelta {
    /// Which choice (0..n).
    pub index: usize,
    /// The text it adds (the first chunk also names the role).
    pub delta: Delta,
    /// Logprobs of the tokens behind `delta`, when asked for.
    pub logprobs: Option<ChatLogprobs>,
    /// Set in the choice's last chunk.
    pub finish_reason: Option<String>,
}

/// What a chat chunk adds.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct Delta {
    /// `assistant` in a choice's first chunk.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub role: Option<String>,
    /// The new text.
    #[serde(default)]
    pub content: String,
}

/// The chat API's logprobs: one entry per token.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct ChatLogprobs {
    /// Per token.
    pub content: Vec<ChatLogprob>,
    /// Always `null` here.
    #[serde(default)]
    pub refusal: Option<String>,
}

/// One token of a chat answer with its logprob and alternatives.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ChatLogprob {
    /// The token as text, or `token_id:N`.
    pub token: String,
    /// Its logprob.
    pub logprob: Option<f64>,
    /// The token's UTF-8 bytes.
    pub bytes: Vec<u8>,
    /// The position's most likely tokens.
    #[serde(default)]
    pub top_logprobs: Vec<TopLogprob>,
}

/// One alternative at a position.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TopLogprob {
    /// The token as text, or `token_id:N`.
    pub token: String,
    /// Its logprob.
    pub logprob: f64,
    /// Its UTF-8 bytes.
    pub bytes: Vec<u8>,
}

/// An error answer: `{"error": {...}}`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ErrorBody {
    /// The error.
    pub error: ApiError,
}

/// What went wrong.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ApiError {
    /// A message naming the value.
    pub message: String,
    /// `invalid_request_error`, `not_found_error`, …
    #[serde(rename = "type")]
    pub kind: String,
    /// The request field at fault.
    pub param: Option<String>,
    /// A machine-readable code (`invalid_api_key`).
    pub code: Option<String>,
}

impl ErrorBody {
    /// An error of type `kind` about `param`.
    pub fn new(kind: &str, message: impl Into<String>, param: Option<&str>, code: Option<&str>) -> Self {
        ErrorBody {
            error: ApiError {
                message: message.into(),
                kind: kind.to_string(),
                param: param.map(str::to_string),
                code: code.map(str::to_string),
            },
        }
    }
}

/// `GET /v1/models`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ModelList {
    /// `list`.
    pub object: String,
    /// The served models.
    pub data: Vec<ModelCard>,
}

/// One served model.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ModelCard {
    /// Its name (the request's `model`).
    pub id: String,
    /// `model`.
    pub object: String,
    /// Unix seconds.
    pub created: u64,
    /// Who serves it.
    pub owned_by: String,
    /// Its context length in tokens (vLLM's field).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_model_len: Option<usize>,
}

/// `POST /v1/load_weights` (streamrl's in-flight weight update): both fields are required;
/// they are options so that a missing one is reported by name.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct LoadWeights {
    /// A checkpoint directory the server can read, or the `http://` URL of one.
    pub path: Option<String>,
    /// The policy version it holds.
    pub version: Option<u32>,
    /// The checkpoint's content hash, checked before the swap.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub sha256: Option<String>,
}

/// The answer to [`LoadWeights`]: the version now served.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Loaded {
    /// The version now served.
    pub version: u32,
}

/// The API's name of a finish reason (`tool_calls` only in chat; a cancelled choice
/// reports `stop`).
pub fn finish_name(reason: FinishReason, chat: bool) -> &'static str {
    match reason {
        FinishReason::Length => "length",
        FinishReason::ToolCall if chat => "tool_calls",
        _ => "stop",
    }
}

impl TextChoice {
    /// The engine [`Output`] of request `id` that this choice answers for a request made by
    /// [`super::Request::for_sample`] from `params`: token ids from `token_id:N` logprob
    /// tokens, their logprobs, per-token versions when the server reports them (`version`
    /// otherwise). A choice that ends in one of `params.tool_call_stop` is a tool call;
    /// ordinary stop strings are cut from the text, as the local engine does. The
    /// timestamps are left 0 for the caller.
    pub fn into_output(
        self,
        id: u64,
        prompt_len: usize,
        params: &SamplingParams,
        version: u32,
    ) -> Result<Output, String> {
        let lp = self.logprobs.ok_or("the server returned no logprobs")?;
        let tokens: Vec<u32> = lp
            .tokens
            .iter()
            .map(|t| {
                t.strip_prefix("token_id:").and_then(|n| n.parse().ok()).ok_or_else(|| {
                    format!("token `{t}` is not `token_id:N`: the server must support return_tokens_as_token_ids")
                })
            })
            .collect::<Result<_, _>>()?;
        let logprobs: Vec<f32> = lp
            .token_logprobs
            .iter()
            .enumerate()
            .map(|(i, x)| {
                x.map(|v| v as f32)
                    .ok_or_else(|| format!("token {i} has no logprob (null)"))
            })
            .collect::<Result<_, _>>()?;
        if logprobs.len() != tokens.len() {
            return Err(format!("{} tokens but {} logprobs", tokens.len(), logprobs.len()));
        }
        let versions = match self.policy_versions {
            Some(v) if v.len() == tokens.len() => v,
            _ => vec![version; tokens.len()],
        };
        let mut text = self.text;
        let reason = match self.finish_reason.as_deref() {
            Some("length") => FinishReason::Length,
            _ if params.tool_call_stop.iter().any(|m| text.ends_with(m.as_str())) => FinishReason::ToolCall,
            _ => FinishReason::Stop,
        };
        // Ordinary stop strings stay out of the text, as with the local engine.
        for s in &params.stop {
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
            // A remote server reports no routing.
            routes: Vec::new(),
            text,
            finish_reason: reason,
            queued_at: 0,
            started_at: 0,
            finished_at: 0,
        })
    }
}
