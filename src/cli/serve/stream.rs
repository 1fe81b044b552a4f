//! Streamed answers: server-sent events, one chunk per piece of text that is safe to send.

use std::sync::Arc;

use axum::response::sse::Event as SseEvent;
use streamrl_model::engine::PromptScores;
use streamrl_model::openai::{self, ErrorBody, Usage, finish_name};
use tokio::sync::mpsc;

use super::AppState;
use super::answer::{Head, Render, prompt_entries};
use super::engine::{Ev, Tok};
use super::routes::Parsed;

/// Per choice of a streamed answer: the tokens of its text, how much text was sent, the
/// tokens whose logprobs wait for the text they belong to, the next text offset.
#[derive(Default)]
struct Choice {
    text_tokens: Vec<u32>,
    sent: usize,
    pending: Vec<Tok>,
    offset: usize,
}

/// Streams the answer: chunks as text becomes safe to send (a possible stop string and a
/// partial UTF-8 character held back), then each choice's finish, then usage.
pub async fn stream(
    s: Arc<AppState>,
    p: Parsed,
    head: Head,
    scores: Option<PromptScores>,
    mut rx: mpsc::UnboundedReceiver<(usize, Ev)>,
    out: mpsc::UnboundedSender<String>,
) {
    let c = &p.c;
    let r = Render::new(&s, c, head.chat);
    let hold = c.stop.iter().map(String::len).max().unwrap_or(0);
    let mut choices: Vec<Choice> = (0..c.n).map(|_| Choice::default()).collect();
    let mut completion_tokens = 0;
    for (i, ch) in choices.iter_mut().enumerate() {
        if head.chat {
            let _ = out.send(head.chunk(c, i, "", None, None, true));
        } else if c.echo {
            let lp = c
                .logprobs
                .map(|_| r.logprobs(&prompt_entries(&p.prompt, scores.as_ref()), &mut ch.offset));
            let _ = out.send(head.chunk(c, i, &p.prompt_text, lp, None, false));
        }
    }
    let mut done = 0;
    while let Some((i, ev)) = rx.recv().await {
        let ch = &mut choices[i];
        match ev {
            Ev::Token(t) => {
                let stop_token = r.is_stop_token(t.token);
                if !stop_token {
                    ch.text_tokens.push(t.token);
                }
                if !stop_token || c.token_ids {
                    ch.pending.push(t);
                }
                if stop_token {
                    continue;
                }
                let text = s.tokenizer.decode(&ch.text_tokens).unwrap_or_default();
                let safe = safe_end(&text, hold);
                if text[..safe].ends_with('\u{FFFD}') || safe <= ch.sent {
                    continue;
                }
                let lp = r.streamed(&std::mem::take(&mut ch.pending), &mut ch.offset);
                let _ = out.send(head.chunk(c, i, &text[ch.sent..safe], lp, None, false));
                ch.sent = safe;
            }
            Ev::Done(o) => {
                completion_tokens += o.tokens.len();
                let rest = o.text.get(ch.sent..).unwrap_or_default();
                if !rest.is_empty() || !ch.pending.is_empty() {
                    let lp = r.streamed(&std::mem::take(&mut ch.pending), &mut ch.offset);
                    let _ = out.send(head.chunk(c, i, rest, lp, None, false));
                }
                let finish = finish_name(o.finish_reason, head.chat);
                let _ = out.send(head.chunk(c, i, "", None, Some(finish), false));
                done += 1;
                if done == c.n {
                    break;
                }
            }
            Ev::Error(e) => {
                let body = ErrorBody::new("invalid_request_error", e, None, None);
                let _ = out.send(serde_json::to_string(&body).unwrap_or_default());
                let _ = out.send("[DONE]".to_string());
                return;
            }
        }
    }
    if c.include_usage {
        let _ = out.send(usage_chunk(&head, p.prompt.len(), completion_tokens));
    }
    let _ = out.send("[DONE]".to_string());
}

/// How much of `text` can be sent: all but the last `hold` bytes (where a stop string may
/// still begin), cut back to a character boundary.
fn safe_end(text: &str, hold: usize) -> usize {
    let mut safe = text.len().saturating_sub(hold);
    while !text.is_char_boundary(safe) {
        safe -= 1;
    }
    safe
}

/// The last chunk of a stream asked to include usage: no choices, the token counts.
fn usage_chunk(head: &Head, prompt_tokens: usize, completion_tokens: usize) -> String {
    let usage = Some(Some(Usage::new(prompt_tokens, completion_tokens)));
    let object = if head.chat {
        "chat.completion.chunk"
    } else {
        "text_completion"
    };
    serde_json::to_string(&head.answer::<openai::TextChoice>(object, vec![], usage)).unwrap_or_default()
}

/// A server-sent-event stream fed by a task that sends data strings.
pub fn async_stream<F, Fut>(
    f: F,
) -> impl futures::Stream<Item = std::result::Result<SseEvent, std::convert::Infallible>> + Send + 'static
where
    F: FnOnce(mpsc::UnboundedSender<String>) -> Fut,
    Fut: std::future::Future<Output = ()> + Send + 'static,
{
    let (tx, rx) = mpsc::unbounded_channel();
    tokio::spawn(f(tx));
    futures::stream::unfold(rx, |mut rx| async move {
        rx.recv().await.map(|data| (Ok(SseEvent::default().data(data)), rx))
    })
}
