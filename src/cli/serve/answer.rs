//! Answers: a checked request's choices run on the engine thread and come back as one
//! typed [`openai`](streamrl_model::openai) answer or as a stream of chunks.

use std::sync::Arc;

use axum::http::StatusCode;
use axum::response::sse::Sse;
use axum::response::{IntoResponse, Response};
use streamrl_model::Tokenizer;
use streamrl_model::engine::{FinishReason, Output, PromptScores, SamplingParams};
use streamrl_model::openai::{
    AssistantMessage, ChatChoice, ChatDelta, ChatLogprob, ChatLogprobs, Checked, Completion, Delta, TextChoice,
    TextLogprobs, TopLogprob, Usage, finish_name,
};
use tokio::sync::mpsc;

use super::AppState;
use super::engine::{Add, Cmd, Ev, Tok};
use super::routes::{Parsed, error, now};
use super::stream::{async_stream, stream};

/// One logprob entry: a token, its logprob (none for the first prompt token) and the
/// alternatives at its position.
pub struct Entry<'a> {
    token: u32,
    logprob: Option<f32>,
    top: Option<&'a [(u32, f32)]>,
}

/// Logprobs in one endpoint's format.
pub enum Logprobs {
    Text(TextLogprobs),
    Chat(ChatLogprobs),
}

impl Logprobs {
    fn text(self) -> Option<TextLogprobs> {
        match self {
            Logprobs::Text(t) => Some(t),
            Logprobs::Chat(_) => None,
        }
    }

    fn chat(self) -> Option<ChatLogprobs> {
        match self {
            Logprobs::Chat(c) => Some(c),
            Logprobs::Text(_) => None,
        }
    }
}

/// Renders tokens and logprobs in the endpoint's format.
pub struct Render<'a> {
    tokenizer: &'a Tokenizer,
    eos: Option<u32>,
    chat: bool,
    c: &'a Checked,
    /// The choices' sampling parameters (which tokens end a choice).
    params: SamplingParams,
}

impl<'a> Render<'a> {
    pub fn new(s: &'a AppState, c: &'a Checked, chat: bool) -> Self {
        Render {
            tokenizer: &s.tokenizer,
            eos: s.tokenizer.eos,
            chat,
            c,
            params: c.sampling(0),
        }
    }

    /// A token as text, or `token_id:N`.
    fn piece(&self, t: u32) -> String {
        if self.c.token_ids {
            format!("token_id:{t}")
        } else {
            self.tokenizer.decode(std::slice::from_ref(&t)).unwrap_or_default()
        }
    }

    /// Whether `t` ends a choice without being part of its text.
    pub fn is_stop_token(&self, t: u32) -> bool {
        self.params.ends_at(t, self.eos)
    }

    /// How many of `o`'s tokens its logprobs show: all but a final stop token (which the
    /// text leaves out), except in `token_ids` mode, whose callers train on it.
    fn shown(&self, o: &Output) -> usize {
        match o.tokens.last() {
            Some(&t) if !self.c.token_ids && o.finish_reason == FinishReason::Stop && self.is_stop_token(t) => {
                o.tokens.len() - 1
            }
            _ => o.tokens.len(),
        }
    }

    /// The logprobs of `entries`; completions' `text_offset` starts at `offset`, which
    /// moves past them.
    pub fn logprobs(&self, entries: &[Entry], offset: &mut usize) -> Logprobs {
        if self.chat {
            let content = entries
                .iter()
                .map(|e| {
                    let piece = self.piece(e.token);
                    let top_logprobs = e
                        .top
                        .unwrap_or_default()
                        .iter()
                        .map(|&(t, lp)| {
                            let token = self.piece(t);
                            TopLogprob {
                                bytes: token.as_bytes().to_vec(),
                                token,
                                logprob: lp as f64,
                            }
                        })
                        .collect();
                    ChatLogprob {
                        bytes: piece.as_bytes().to_vec(),
                        token: piece,
                        logprob: e.logprob.map(f64::from),
                        top_logprobs,
                    }
                })
                .collect();
            return Logprobs::Chat(ChatLogprobs { content, refusal: None });
        }
        let mut out = TextLogprobs::default();
        for e in entries {
            let piece = self.piece(e.token);
            out.text_offset.push(*offset);
            *offset += piece.len();
            // The sampled token is always among its position's alternatives.
            out.top_logprobs.push(e.top.map(|top| {
                let mut m: std::collections::BTreeMap<String, f64> =
                    top.iter().map(|&(t, lp)| (self.piece(t), lp as f64)).collect();
                if let Some(lp) = e.logprob {
                    m.entry(piece.clone()).or_insert(lp as f64);
                }
                m
            }));
            out.token_logprobs.push(e.logprob.map(f64::from));
            out.tokens.push(piece);
        }
        Logprobs::Text(out)
    }

    /// The logprobs of a choice's streamed tokens, when asked for.
    pub fn streamed(&self, toks: &[Tok], offset: &mut usize) -> Option<Logprobs> {
        self.c.logprobs?;
        let entries: Vec<Entry> = toks
            .iter()
            .map(|t| Entry {
                token: t.token,
                logprob: Some(t.logprob),
                top: Some(&t.top),
            })
            .collect();
        Some(self.logprobs(&entries, offset))
    }
}

/// The echoed prompt's entries: the first token has no logprob.
pub fn prompt_entries<'a>(prompt: &[u32], scores: Option<&'a PromptScores>) -> Vec<Entry<'a>> {
    prompt
        .iter()
        .enumerate()
        .map(|(i, &token)| {
            let s = i.checked_sub(1).and_then(|j| scores.and_then(|s| s.get(j)));
            Entry {
                token,
                logprob: s.map(|s| s.0),
                top: s.map(|s| s.1.as_slice()),
            }
        })
        .collect()
}

/// Runs a checked request: its `n` choices on the engine, answered whole or streamed.
pub async fn run(s: Arc<AppState>, p: Parsed, chat: bool) -> Response {
    // `echo` with logprobs scores the prompt first.
    let scores = if p.c.echo && p.c.logprobs.is_some() {
        let (reply, rx) = tokio::sync::oneshot::channel();
        let cmd = Cmd::Score {
            prompt: p.prompt.clone(),
            top: p.c.logprobs.unwrap_or(0),
            reply,
        };
        if s.engine.send(cmd).is_err() {
            return error(StatusCode::SERVICE_UNAVAILABLE, "the engine has stopped", None);
        }
        match rx.await {
            Ok(Ok(v)) => Some(v),
            Ok(Err(e)) => return error(StatusCode::BAD_REQUEST, e, Some("prompt")),
            Err(_) => return error(StatusCode::SERVICE_UNAVAILABLE, "the engine has stopped", None),
        }
    } else {
        None
    };
    let (tx, rx) = mpsc::unbounded_channel();
    // `max_tokens: 0` (only with echo) generates nothing: every choice is the prompt.
    if p.c.max_tokens > 0 {
        for index in 0..p.c.n {
            let add = Add {
                prompt: p.prompt.clone(),
                params: p.c.sampling(index),
                index,
                events: tx.clone(),
            };
            if s.engine.send(Cmd::Add(add)).is_err() {
                return error(StatusCode::SERVICE_UNAVAILABLE, "the engine has stopped", None);
            }
        }
    } else {
        for index in 0..p.c.n {
            let _ = tx.send((index, Ev::Done(empty_output(p.prompt.len()))));
        }
    }
    drop(tx);
    let head = Head {
        id: format!(
            "{}-{}",
            if chat { "chatcmpl" } else { "cmpl" },
            uuid::Uuid::new_v4().simple()
        ),
        created: now(),
        model: s.model.clone(),
        chat,
    };
    if p.c.stream {
        let stream = async_stream(move |out| stream(s, p, head, scores, rx, out));
        return Sse::new(stream).into_response();
    }
    whole(&s, &p, head, scores.as_ref(), rx).await
}

/// What every answer and chunk of one request shares.
pub struct Head {
    id: String,
    created: u64,
    model: String,
    /// The chat endpoint's answer.
    pub chat: bool,
}

impl Head {
    pub fn answer<C>(&self, object: &str, choices: Vec<C>, usage: Option<Option<Usage>>) -> Completion<C> {
        Completion {
            id: self.id.clone(),
            object: object.to_string(),
            created: self.created,
            model: self.model.clone(),
            choices,
            usage,
        }
    }

    /// One streamed chunk of choice `index` as JSON.
    pub fn chunk(
        &self,
        c: &Checked,
        index: usize,
        delta: &str,
        lp: Option<Logprobs>,
        finish: Option<&str>,
        first: bool,
    ) -> String {
        let usage = c.include_usage.then_some(None);
        let finish_reason = finish.map(str::to_string);
        let json = if self.chat {
            let delta = Delta {
                role: first.then(|| "assistant".to_string()),
                content: delta.to_string(),
            };
            let logprobs = lp.and_then(Logprobs::chat);
            let choice = ChatDelta {
                index,
                delta,
                logprobs,
                finish_reason,
            };
            serde_json::to_string(&self.answer("chat.completion.chunk", vec![choice], usage))
        } else {
            let logprobs = lp.and_then(Logprobs::text);
            let choice = TextChoice {
                index,
                text: delta.to_string(),
                logprobs,
                finish_reason,
                policy_versions: None,
            };
            serde_json::to_string(&self.answer("text_completion", vec![choice], usage))
        };
        json.unwrap_or_default()
    }
}

/// The whole answer once every choice is done.
async fn whole(
    s: &AppState,
    p: &Parsed,
    head: Head,
    scores: Option<&PromptScores>,
    mut rx: mpsc::UnboundedReceiver<(usize, Ev)>,
) -> Response {
    let mut outputs: Vec<Option<Output>> = vec![None; p.c.n];
    while let Some((i, ev)) = rx.recv().await {
        match ev {
            Ev::Token(_) => {}
            Ev::Done(o) => outputs[i] = Some(o),
            Ev::Error(e) => return error(StatusCode::BAD_REQUEST, e, None),
        }
    }
    let outputs: Vec<Output> = outputs.into_iter().flatten().collect();
    let completion_tokens: usize = outputs.iter().map(|o| o.tokens.len()).sum();
    let usage = Some(Some(Usage::new(p.prompt.len(), completion_tokens)));
    let r = Render::new(s, &p.c, head.chat);
    let logprobs = |o: &Output| {
        p.c.logprobs.map(|_| {
            let mut entries = if p.c.echo {
                prompt_entries(&p.prompt, scores)
            } else {
                Vec::new()
            };
            entries.extend((0..r.shown(o)).map(|j| Entry {
                token: o.tokens[j],
                logprob: Some(o.logprobs[j]),
                top: o.top_logprobs.get(j).map(Vec::as_slice),
            }));
            r.logprobs(&entries, &mut 0)
        })
    };
    let choices = outputs.iter().enumerate();
    if head.chat {
        let choices = choices
            .map(|(index, o)| ChatChoice {
                index,
                message: AssistantMessage {
                    role: "assistant".into(),
                    content: Some(o.text.clone()),
                },
                logprobs: logprobs(o).and_then(Logprobs::chat),
                finish_reason: Some(finish_name(o.finish_reason, true).into()),
            })
            .collect();
        return axum::Json(head.answer("chat.completion", choices, usage)).into_response();
    }
    let choices = choices
        .map(|(index, o)| TextChoice {
            index,
            text: format!("{}{}", p.prompt_text, o.text),
            logprobs: logprobs(o).and_then(Logprobs::text),
            finish_reason: Some(finish_name(o.finish_reason, false).into()),
            policy_versions: p.c.token_ids.then(|| o.versions.clone()),
        })
        .collect();
    axum::Json(head.answer("text_completion", choices, usage)).into_response()
}

/// A choice that generated nothing (`max_tokens: 0` with `echo`).
fn empty_output(prompt_len: usize) -> Output {
    Output {
        id: 0,
        prompt_len,
        tokens: Vec::new(),
        logprobs: Vec::new(),
        top_logprobs: Vec::new(),
        versions: Vec::new(),
        routes: Vec::new(),
        text: String::new(),
        finish_reason: FinishReason::Length,
        queued_at: 0,
        started_at: 0,
        finished_at: 0,
    }
}
