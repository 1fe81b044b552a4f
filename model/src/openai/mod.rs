//! The OpenAI API on the wire, typed: one place for the request and answer bodies that
//! `streamrl serve` reads and writes and that the rollout stage's remote engine
//! (`engine: openai://…`, talking to `streamrl serve`, vLLM or SGLang) writes and reads,
//! with the conversions to and from the engine's [`SamplingParams`] and [`Output`].
//!
//! ```
//! use streamrl_model::engine::{FinishReason, SamplingParams};
//! use streamrl_model::openai::{Request, TextCompletion};
//!
//! // The remote engine's request for one sample…
//! let params = SamplingParams { max_tokens: 8, tool_call_stop: vec!["</python>".into()], ..Default::default() };
//! let body = serde_json::to_value(Request::for_sample(&[1, 2, 3], &params, None)).unwrap();
//! assert_eq!(body["prompt"], serde_json::json!([1, 2, 3]));
//! assert_eq!(body["return_tokens_as_token_ids"], true);
//!
//! // …and a server's answer, read back as the engine's output.
//! let answer: TextCompletion = serde_json::from_str(r#"{
//!     "id": "cmpl-1", "object": "text_completion", "created": 0, "model": "m",
//!     "choices": [{"index": 0, "text": "print(1)</python>", "finish_reason": "stop",
//!                  "logprobs": {"tokens": ["token_id:7", "token_id:9"], "token_logprobs": [-0.5, -0.25]}}]
//! }"#).unwrap();
//! let choice = answer.choices.into_iter().next().unwrap();
//! let out = choice.into_output(0, 3, &params, 4).unwrap();
//! assert_eq!((out.tokens, out.versions, out.finish_reason), (vec![7, 9], vec![4, 4], FinishReason::ToolCall));
//! ```
//!
//! [`SamplingParams`]: crate::engine::SamplingParams
//! [`Output`]: crate::engine::Output

mod request;
mod response;

pub use request::{Checked, Content, Logprobs, Message, Part, Problem, Request, Seed, Stop, StreamOptions, parse};
pub use response::{
    ApiError, AssistantMessage, ChatChoice, ChatChunk, ChatCompletion, ChatDelta, ChatLogprob, ChatLogprobs,
    Completion, Delta, ErrorBody, LoadWeights, Loaded, ModelCard, ModelList, TextChoice, TextCompletion, TextLogprobs,
    TopLogprob, Usage, finish_name,
};
