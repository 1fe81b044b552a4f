//! The OpenAI wire types against golden bodies (`tests/fixtures/openai/`): streamrl's own
//! answers read back unchanged, a vLLM answer (with the fields vLLM adds) reads as the
//! engine output the rollout stage trains on, and the remote engine's request is the
//! golden one. When a body changes on purpose, paste the new one over the file.

use serde::Serialize;
use serde::de::DeserializeOwned;
use serde_json::Value;
use streamrl_model::engine::{FinishReason, Output, SamplingParams};
use streamrl_model::openai::{ChatChunk, ChatCompletion, ErrorBody, Request, TextChoice, TextCompletion};

fn golden(name: &str) -> String {
    let path = format!("{}/../tests/fixtures/openai/{name}", env!("CARGO_MANIFEST_DIR"));
    std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{path}: {e}"))
}

/// Reads `name` as `T` and checks that writing it back gives the same JSON.
fn round_trip<T: DeserializeOwned + Serialize>(name: &str) -> T {
    let text = golden(name);
    let value: T = serde_json::from_str(&text).unwrap_or_else(|e| panic!("{name}: {e}"));
    let want: Value = serde_json::from_str(&text).unwrap();
    assert_eq!(
        serde_json::to_value(&value).unwrap(),
        want,
        "{name} changed in a round trip"
    );
    value
}

#[test]
fn streamrl_answers_read_back_unchanged() {
    let c: TextCompletion = round_trip("streamrl_completion.json");
    assert_eq!(c.choices[0].policy_versions.as_deref(), Some(&[3, 3, 4, 4][..]));
    let c: ChatCompletion = round_trip("streamrl_chat.json");
    assert_eq!(c.choices[0].message.content.as_deref(), Some("\\boxed{7}"));
    // A chunk's `"usage": null` (more chunks to come) stays apart from no usage at all.
    let c: ChatChunk = round_trip("streamrl_chat_chunk.json");
    assert_eq!(c.usage, Some(None));
    let e: ErrorBody = round_trip("error.json");
    assert_eq!(e.error.param.as_deref(), Some("temperature"));
}

fn tool_params() -> SamplingParams {
    SamplingParams {
        stop: vec!["\n\n".into()],
        tool_call_stop: vec!["</python>".into()],
        ..Default::default()
    }
}

/// The first choice of `c` as the output of request `id` with a `prompt_len`-token prompt,
/// under the tool-use sampling parameters, while policy `version` is the newest.
fn first_output(c: TextCompletion, id: u64, prompt_len: usize, version: u32) -> Output {
    c.choices
        .into_iter()
        .next()
        .unwrap()
        .into_output(id, prompt_len, &tool_params(), version)
        .unwrap()
}

#[test]
fn a_vllm_answer_reads_as_the_engine_output() {
    let c: TextCompletion = serde_json::from_str(&golden("vllm_completion.json")).unwrap();
    assert_eq!(c.usage.flatten().map(|u| u.completion_tokens), Some(8));
    let o = first_output(c, 5, 41, 7);
    assert_eq!(o.tokens, [27, 1350, 7, 21, 9, 22, 8, 524]);
    assert_eq!(o.logprobs[..3], [-0.0123f32, -0.5, -0.03125]);
    // vLLM reports no versions: every token gets the version last pushed.
    assert_eq!(o.versions, [7; 8]);
    // The tool-call marker stays in the text and makes it a tool call.
    assert_eq!(
        (o.text.as_str(), o.finish_reason),
        ("<python>print(6*7)</python>", FinishReason::ToolCall)
    );
    assert_eq!((o.id, o.prompt_len), (5, 41));
}

#[test]
fn streamrl_answers_carry_versions_and_lose_stop_strings() {
    let c: TextCompletion = serde_json::from_str(&golden("streamrl_completion.json")).unwrap();
    let o = first_output(c, 1, 9, 2);
    assert_eq!(o.versions, [3, 3, 4, 4]);
    assert_eq!((o.text.as_str(), o.finish_reason), ("42", FinishReason::Stop));
}

#[test]
fn answers_the_rollout_cannot_train_on_are_named() {
    let choice = |logprobs: Value| -> TextChoice {
        serde_json::from_value(
            serde_json::json!({"index": 0, "text": "x", "finish_reason": "length", "logprobs": logprobs}),
        )
        .unwrap()
    };
    let p = SamplingParams::default();
    let e = choice(serde_json::json!({"tokens": ["x"], "token_logprobs": [-1.0]})).into_output(1, 1, &p, 0);
    assert!(e.unwrap_err().contains("return_tokens_as_token_ids"));
    let e = choice(serde_json::json!({"tokens": ["token_id:1", "token_id:2"], "token_logprobs": [-1.0]}))
        .into_output(1, 1, &p, 0);
    assert!(e.unwrap_err().contains("2 tokens but 1 logprobs"));
    let e = choice(serde_json::json!({"tokens": ["token_id:1"], "token_logprobs": [null]})).into_output(1, 1, &p, 0);
    assert!(e.unwrap_err().contains("no logprob"));
    assert!(
        choice(Value::Null)
            .into_output(1, 1, &p, 0)
            .unwrap_err()
            .contains("no logprobs")
    );
    let o = choice(serde_json::json!({"tokens": ["token_id:1"], "token_logprobs": [-1.0]}))
        .into_output(1, 1, &p, 0)
        .unwrap();
    assert_eq!(o.finish_reason, FinishReason::Length);
}

#[test]
fn the_remote_engines_request_is_the_golden_one() {
    let params = SamplingParams {
        temperature: 1.0,
        top_p: 0.5,
        top_k: 20,
        seed: u64::MAX,
        max_tokens: 64,
        ignore_eos: true,
        ..tool_params()
    };
    let sent = serde_json::to_value(Request::for_sample(&[1, 2, 3], &params, Some("policy"))).unwrap();
    let want: Value = serde_json::from_str(&golden("sample_request.json")).unwrap();
    assert_eq!(sent, want);
    // What `streamrl serve` reads from it: the same sampling, the markers kept in the text.
    let req: Request = streamrl_model::openai::parse(golden("sample_request.json").as_bytes()).unwrap();
    let c = req.check(false, 3, 128, 16).unwrap();
    assert_eq!(
        (c.temperature, c.top_p, c.top_k, c.max_tokens, c.seed),
        (1.0, 0.5, 20, 64, Some(u64::MAX))
    );
    assert!(c.keep_stop && c.token_ids && c.ignore_eos);
    let back = c.sampling(0);
    assert_eq!(back.tool_call_stop, ["\n\n", "</python>"]);
}
