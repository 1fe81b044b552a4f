//! The scheduler's state and bookkeeping, shared by both step backends: who waits, who
//! runs, sampling the next token from a logits row, retiring finished sequences.

use std::collections::VecDeque;
use std::time::{SystemTime, UNIX_EPOCH};

use rand::rngs::StdRng;

use streamrl_kernels::cores;

use super::sample::sample;
use super::{EngineConfig, EngineStats, Event, FinishReason, Output, SamplingParams};
use crate::infer::SeqKv;
use crate::model::KvCache;
use crate::{Result, Tokenizer, Transformer};

/// One request, waiting or running.
pub(crate) struct Seq {
    pub(crate) id: u64,
    pub(crate) prompt: Vec<u32>,
    pub(crate) params: SamplingParams,
    pub(crate) rng: StdRng,
    /// Candle path: the prompt's cache between prefill and joining the batch.
    pub(crate) cache: Option<KvCache>,
    /// CPU kernels: this sequence's keys and values.
    pub(crate) kv: Option<SeqKv>,
    pub(crate) tokens: Vec<u32>,
    pub(crate) logprobs: Vec<f32>,
    pub(crate) top_logprobs: Vec<Vec<(u32, f32)>>,
    pub(crate) versions: Vec<u32>,
    pub(crate) text_len_checked: usize,
    pub(crate) queued_at: i64,
    pub(crate) started_at: i64,
}

impl Seq {
    /// Cache positions it may need: prompt plus `max_tokens`.
    pub(crate) fn budget(&self) -> usize {
        self.prompt.len() + self.params.max_tokens
    }
}

/// Everything the engine holds but its step backend.
pub(crate) struct Core {
    pub(crate) model: Transformer,
    pub(crate) version: u32,
    pub(crate) tokenizer: Option<Tokenizer>,
    pub(crate) cfg: EngineConfig,
    pub(crate) waiting: VecDeque<Seq>,
    pub(crate) running: Vec<Seq>,
    pub(crate) next_id: u64,
    pub(crate) stats: EngineStats,
    /// Admit nothing ([`Engine::hold_admissions`](super::Engine::hold_admissions)).
    pub(crate) hold: bool,
}

/// Milliseconds since the Unix epoch.
pub(crate) fn now_ms() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_millis() as i64)
        .unwrap_or(0)
}

impl Core {
    /// Takes the waiting requests that fit (slots, KV budget, prefill budget) in arrival
    /// order. With sequences running, waits until `min_batch` slots are free (or fewer
    /// than that are waiting).
    pub(crate) fn admit(&mut self, min_batch: usize) -> Vec<Seq> {
        if self.hold {
            return Vec::new();
        }
        let free = self.cfg.max_num_seqs.saturating_sub(self.running.len());
        if !self.running.is_empty() && free < min_batch && self.waiting.len() >= min_batch {
            return Vec::new();
        }
        let mut kv: usize = self.running.iter().map(Seq::budget).sum();
        let mut prefill = 0;
        let mut admitted = Vec::new();
        while let Some(next) = self.waiting.front() {
            let room = self.running.len() + admitted.len() < self.cfg.max_num_seqs;
            let fits_kv = kv + next.budget() <= self.cfg.max_kv_tokens;
            let fits_prefill = admitted.is_empty() || prefill + next.prompt.len() <= self.cfg.max_prefill_tokens;
            if !(room && fits_kv && fits_prefill) {
                break;
            }
            let s = self.waiting.pop_front().expect("front exists");
            kv += s.budget();
            prefill += s.prompt.len();
            admitted.push(s);
        }
        admitted
    }

    /// Samples one token per sequence from its logits row, records it, and retires the
    /// sequences that finished.
    /// Returns the sequences still running, with their index in `seqs`.
    pub(crate) fn advance(
        &mut self,
        mut seqs: Vec<Seq>,
        rows: Vec<Vec<f32>>,
        events: &mut Vec<Event>,
    ) -> Result<Vec<(usize, Seq)>> {
        let ctx = self.model.config().max_positions;
        let eos = self.tokenizer.as_ref().and_then(|t| t.eos);
        let mut kept = Vec::with_capacity(seqs.len());
        // Each row's pick depends on its row and its sequence's generator alone: rows
        // spread over the cores a step is given (inside `cores::spread`), the same picks.
        let mut picks = vec![None; seqs.len()];
        let items: Vec<_> = seqs.iter_mut().zip(&rows).zip(picks.iter_mut()).collect();
        cores::each(items, |((s, row), pick)| {
            *pick = Some(sample(row, &s.params, &mut s.rng))
        });
        for (r, (mut s, pick)) in seqs.into_iter().zip(picks).enumerate() {
            let (token, logprob, top) = pick.expect("every row was sampled");
            s.tokens.push(token);
            s.logprobs.push(logprob);
            s.top_logprobs.push(top.clone());
            s.versions.push(self.version);
            self.stats.generated += 1;
            events.push(Event::Token {
                id: s.id,
                token,
                logprob,
                top,
                version: self.version,
            });
            let finish = if s.params.ends_at(token, eos) {
                Some(FinishReason::Stop)
            } else if let Some(r) = self.stop_string(&mut s)? {
                Some(r)
            } else if s.tokens.len() >= s.params.max_tokens || s.prompt.len() + s.tokens.len() >= ctx {
                Some(FinishReason::Length)
            } else {
                None
            };
            match finish {
                Some(r) => {
                    let out = self.finish(s, r);
                    events.push(Event::Done(out));
                }
                None => kept.push((r, s)),
            }
        }
        Ok(kept)
    }

    /// Whether the text so far contains a stop string or tool-call marker.
    fn stop_string(&self, s: &mut Seq) -> Result<Option<FinishReason>> {
        let Some(tok) = &self.tokenizer else { return Ok(None) };
        if s.params.stop.is_empty() && s.params.tool_call_stop.is_empty() {
            return Ok(None);
        }
        let text = tok.decode(&s.tokens)?;
        let longest = s
            .params
            .stop
            .iter()
            .chain(&s.params.tool_call_stop)
            .map(String::len)
            .max()
            .unwrap_or(0);
        let mut from = s.text_len_checked.saturating_sub(longest);
        while !text.is_char_boundary(from.min(text.len())) {
            from -= 1;
        }
        let tail = &text[from.min(text.len())..];
        s.text_len_checked = text.len();
        let hit = |list: &[String]| list.iter().any(|m| tail.contains(m.as_str()));
        Ok(if hit(&s.params.tool_call_stop) {
            Some(FinishReason::ToolCall)
        } else if hit(&s.params.stop) {
            Some(FinishReason::Stop)
        } else {
            None
        })
    }

    pub(crate) fn finish(&mut self, s: Seq, reason: FinishReason) -> Output {
        // A final end-of-sequence or stop token ends the text; it is not part of it.
        let eos = self.tokenizer.as_ref().and_then(|t| t.eos);
        let shown = match s.tokens.last() {
            Some(&t) if reason == FinishReason::Stop && s.params.ends_at(t, eos) => &s.tokens[..s.tokens.len() - 1],
            _ => &s.tokens[..],
        };
        let mut text = self
            .tokenizer
            .as_ref()
            .and_then(|t| t.decode(shown).ok())
            .unwrap_or_default();
        match reason {
            FinishReason::Stop => {
                if let Some(at) = s.params.stop.iter().filter_map(|m| text.find(m.as_str())).min() {
                    text.truncate(at);
                }
            }
            FinishReason::ToolCall => {
                if let Some(end) = s
                    .params
                    .tool_call_stop
                    .iter()
                    .filter_map(|m| text.find(m.as_str()).map(|at| at + m.len()))
                    .min()
                {
                    text.truncate(end);
                }
            }
            FinishReason::Length | FinishReason::Cancelled => {}
        }
        // The experts each generated token was routed to when it was fed back (a mixture
        // of experts on the CPU kernels); the last token is never fed: no route.
        let per = self
            .model
            .config()
            .moe
            .as_ref()
            .map_or(0, |m| m.top_k * self.model.config().n_layers);
        let routes = match &s.kv {
            Some(kv) if per > 0 => {
                let mut r = kv.routes_from(s.prompt.len(), per).to_vec();
                r.resize(s.tokens.len() * per, crate::NO_ROUTE);
                r
            }
            _ => Vec::new(),
        };
        Output {
            id: s.id,
            prompt_len: s.prompt.len(),
            routes,
            tokens: s.tokens,
            logprobs: s.logprobs,
            top_logprobs: s.top_logprobs,
            versions: s.versions,
            text,
            finish_reason: reason,
            queued_at: s.queued_at,
            started_at: s.started_at,
            finished_at: now_ms(),
        }
    }
}
