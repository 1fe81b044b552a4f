//! The continuous-batching generation engine shared by the rollout stage and `streamrl
//! serve`.
//!
//! Every [`step`](Engine::step) admits waiting requests (up to `max_num_seqs` running and
//! a KV-cache token budget), prefills the newcomers, runs one decode step for every
//! running sequence, and retires finished sequences at once: sequences join and leave the
//! batch at every step.
//!
//! On the CPU (f32 weights) a step is one forward of the [CPU kernels](crate::infer): the
//! running sequences' newest tokens and the newcomers' whole prompts are rows of the same
//! matrix products, and every sequence owns its key/value buffer, so joining and leaving
//! copy nothing. On other devices the engine uses candle ops: newcomers are prefilled as a
//! ragged batch (each into its own cache), then join the running batch's cache
//! ([`BatchKv`]) as rows; a decode step writes every row's new keys and values with one
//! scatter.
//!
//! Every generated token carries its logprob under the temperature-scaled distribution
//! (`log_softmax(logits / T)`, full vocabulary, before top-k/top-p truncation; greedy
//! reports T = 1) and the policy version that produced it. [`Engine::swap`] and
//! [`Engine::load_weights`] replace the weights *between* steps without touching running
//! sequences: their next tokens come from the new weights and carry the new version.
//!
//! ```
//! use streamrl_model::engine::{Engine, EngineConfig, SamplingParams};
//! use streamrl_model::{checkpoint, config, Tokenizer};
//!
//! let tok = Tokenizer::char_level();
//! let hf = config::preset("tiny", tok.vocab_size()).unwrap();
//! let model = checkpoint::init(&hf, &candle_core::Device::Cpu).unwrap().model;
//! let mut engine = Engine::new(model, 0, Some(tok.clone()), EngineConfig::default());
//! let id = engine.add(tok.encode("12+7=").unwrap(), SamplingParams { max_tokens: 4, ..Default::default() }).unwrap();
//! let done = engine.run_to_completion().unwrap();
//! assert_eq!(done[0].id, id);
//! assert_eq!(done[0].tokens.len(), done[0].logprobs.len());
//! ```

use std::collections::VecDeque;
use std::path::Path;
use std::time::{SystemTime, UNIX_EPOCH};

use candle_core::Tensor;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

use crate::infer::{CpuModel, SeqKv};
use crate::model::{BatchKv, KvCache, MASKED};
use crate::{Error, Result, Tokenizer, Transformer, checkpoint};

/// Scheduler limits.
#[derive(Debug, Clone, PartialEq)]
pub struct EngineConfig {
    /// Sequences decoded together at most.
    pub max_num_seqs: usize,
    /// Cached tokens (prompt + generated) over all running sequences at most; a request
    /// is admitted only if its prompt plus `max_tokens` fits next to the running ones.
    pub max_kv_tokens: usize,
    /// Prompt tokens prefilled in one step at most (at least one request is always
    /// admitted when the batch has room).
    pub max_prefill_tokens: usize,
    /// While sequences are running, admit newcomers only once this many slots are free
    /// (on devices where a prefill is a forward pass of its own; 1 admits at every step).
    /// The CPU kernels prefill inside the decode step's forward and always admit at once.
    pub min_prefill_batch: usize,
    /// Run a model whose weights are f32 on the CPU on the [CPU kernels](crate::infer)
    /// (default); false uses candle ops, as on every other device.
    pub cpu_kernels: bool,
}

impl Default for EngineConfig {
    fn default() -> Self {
        EngineConfig {
            max_num_seqs: 64,
            max_kv_tokens: 1 << 20,
            max_prefill_tokens: 8192,
            min_prefill_batch: 4,
            cpu_kernels: true,
        }
    }
}

impl EngineConfig {
    /// Every invalid value.
    pub fn problems(&self) -> Vec<String> {
        let mut p = Vec::new();
        if self.max_num_seqs == 0 {
            p.push("max_num_seqs must be at least 1".into());
        }
        if self.max_kv_tokens == 0 {
            p.push("max_kv_tokens must be at least 1".into());
        }
        if self.max_prefill_tokens == 0 {
            p.push("max_prefill_tokens must be at least 1".into());
        }
        p
    }
}

/// Per-request sampling.
#[derive(Debug, Clone, PartialEq)]
pub struct SamplingParams {
    /// Temperature; 0 is greedy.
    pub temperature: f32,
    /// Nucleus sampling mass (1.0: off).
    pub top_p: f32,
    /// Keep only the k most likely tokens (0: off).
    pub top_k: usize,
    /// RNG seed; requests with the same seed and prompt sample the same tokens whatever
    /// else is in the batch.
    pub seed: u64,
    /// New tokens at most.
    pub max_tokens: usize,
    /// Stop when the text contains one of these (excluded from `text`).
    pub stop: Vec<String>,
    /// Stop when the text contains one of these; `finish_reason` is `tool_call` and the
    /// marker stays in `text`.
    pub tool_call_stop: Vec<String>,
    /// Stop at these token ids (kept in `tokens`).
    pub stop_token_ids: Vec<u32>,
    /// Do not stop at the tokenizer's end-of-sequence token.
    pub ignore_eos: bool,
    /// Also report the `logprobs` most likely tokens at each step with their logprobs
    /// (0: none; at most [`MAX_TOP_LOGPROBS`]).
    pub logprobs: usize,
}

/// Per prompt position after the first: the token's logprob and the most likely tokens
/// there ([`Engine::prompt_logprobs`]).
pub type PromptScores = Vec<(f32, Vec<(u32, f32)>)>;

/// The most alternatives [`SamplingParams::logprobs`] may ask for.
pub const MAX_TOP_LOGPROBS: usize = 20;

impl Default for SamplingParams {
    fn default() -> Self {
        SamplingParams {
            temperature: 1.0,
            top_p: 1.0,
            top_k: 0,
            seed: 0,
            max_tokens: 64,
            stop: Vec::new(),
            tool_call_stop: Vec::new(),
            stop_token_ids: Vec::new(),
            ignore_eos: false,
            logprobs: 0,
        }
    }
}

impl SamplingParams {
    /// Whether `token` ends a sequence under these parameters: one of `stop_token_ids`, or
    /// the tokenizer's end-of-sequence `eos` unless `ignore_eos`. Such a final token stays
    /// in [`Output::tokens`] but is not part of [`Output::text`].
    pub fn ends_at(&self, token: u32, eos: Option<u32>) -> bool {
        self.stop_token_ids.contains(&token) || (!self.ignore_eos && Some(token) == eos)
    }

    /// Every invalid value.
    pub fn problems(&self) -> Vec<String> {
        let mut p = Vec::new();
        if !self.temperature.is_finite() || self.temperature < 0.0 {
            p.push(format!("temperature {} must be a finite number ≥ 0", self.temperature));
        }
        if !(self.top_p > 0.0 && self.top_p <= 1.0) {
            p.push(format!("top_p {} must be in (0, 1]", self.top_p));
        }
        if self.max_tokens == 0 {
            p.push("max_tokens must be at least 1".into());
        }
        if self.stop.iter().chain(&self.tool_call_stop).any(String::is_empty) {
            p.push("stop strings must not be empty".into());
        }
        if self.logprobs > MAX_TOP_LOGPROBS {
            p.push(format!(
                "logprobs {} asks for more than {MAX_TOP_LOGPROBS} alternatives per token",
                self.logprobs
            ));
        }
        p
    }
}

/// Why a sequence finished.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FinishReason {
    /// A stop string, stop token or end-of-sequence.
    Stop,
    /// `max_tokens` (or the model's context) reached.
    Length,
    /// A tool-call marker appeared.
    ToolCall,
    /// Cancelled by the caller.
    Cancelled,
}

impl FinishReason {
    /// The name used in rows and in the OpenAI API.
    pub fn as_str(self) -> &'static str {
        match self {
            FinishReason::Stop => "stop",
            FinishReason::Length => "length",
            FinishReason::ToolCall => "tool_call",
            FinishReason::Cancelled => "cancelled",
        }
    }
}

/// A finished request.
#[derive(Debug, Clone, PartialEq)]
pub struct Output {
    /// Request id from [`Engine::add`].
    pub id: u64,
    /// Prompt tokens.
    pub prompt_len: usize,
    /// Generated tokens.
    pub tokens: Vec<u32>,
    /// Logprob of each generated token (temperature-scaled distribution).
    pub logprobs: Vec<f32>,
    /// Per generated token, the [`SamplingParams::logprobs`] most likely tokens with their
    /// logprobs, most likely first (empty lists when none were asked for).
    pub top_logprobs: Vec<Vec<(u32, f32)>>,
    /// Policy version that produced each token.
    pub versions: Vec<u32>,
    /// Decoded completion (stop string removed), when the engine has a tokenizer.
    pub text: String,
    /// Why it finished.
    pub finish_reason: FinishReason,
    /// When it was added, ms since epoch.
    pub queued_at: i64,
    /// When its prefill ran, ms since epoch.
    pub started_at: i64,
    /// When it finished, ms since epoch.
    pub finished_at: i64,
}

/// What a step produced.
#[derive(Debug, Clone, PartialEq)]
pub enum Event {
    /// A token was generated for request `id`.
    Token {
        /// Request id.
        id: u64,
        /// The token.
        token: u32,
        /// Its logprob.
        logprob: f32,
        /// The most likely tokens at this step with their logprobs (as many as
        /// [`SamplingParams::logprobs`] asked for).
        top: Vec<(u32, f32)>,
        /// Policy version that produced it.
        version: u32,
    },
    /// Request finished.
    Done(Output),
}

struct Seq {
    id: u64,
    prompt: Vec<u32>,
    params: SamplingParams,
    rng: StdRng,
    /// Candle path: the prompt's cache between prefill and joining the batch.
    cache: Option<KvCache>,
    /// CPU kernels: this sequence's keys and values.
    kv: Option<SeqKv>,
    tokens: Vec<u32>,
    logprobs: Vec<f32>,
    top_logprobs: Vec<Vec<(u32, f32)>>,
    versions: Vec<u32>,
    text_len_checked: usize,
    queued_at: i64,
    started_at: i64,
}

impl Seq {
    fn budget(&self) -> usize {
        self.prompt.len() + self.params.max_tokens
    }
}

/// Counters of what the engine did.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct EngineStats {
    /// Steps run.
    pub steps: u64,
    /// Tokens generated.
    pub generated: u64,
    /// Prompt tokens prefilled.
    pub prefilled: u64,
    /// Weight swaps.
    pub swaps: u64,
    /// Sum over decode steps of the batch size (mean batch = this / decode steps).
    pub batch_rows: u64,
    /// Decode forwards.
    pub decode_steps: u64,
}

/// The continuous-batching engine. See the [module docs](self).
pub struct Engine {
    model: Transformer,
    version: u32,
    tokenizer: Option<Tokenizer>,
    cfg: EngineConfig,
    waiting: VecDeque<Seq>,
    running: Vec<Seq>,
    kernels: Kernels,
    next_id: u64,
    stats: EngineStats,
}

/// How the engine evaluates the model.
enum Kernels {
    /// The CPU kernels: one mixed prefill + decode forward per step.
    Cpu(Box<CpuModel>),
    /// candle ops (any device): a ragged prefill, then a batched decode whose keys and
    /// values are the rows of `BatchKv` (row r = running[r]).
    Candle(BatchKv),
}

impl Kernels {
    fn for_model(model: &Transformer, cpu_kernels: bool) -> Kernels {
        match cpu_kernels.then(|| CpuModel::new(model)) {
            Some(Ok(c)) => Kernels::Cpu(Box::new(c)),
            // Asked for candle, or not f32 on the CPU: candle ops serve it.
            _ => Kernels::Candle(BatchKv::default()),
        }
    }
}

fn now_ms() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_millis() as i64)
        .unwrap_or(0)
}

impl Engine {
    /// An engine serving `model` as policy `version`. Without a tokenizer, stop strings
    /// are not checked and `text` is empty.
    pub fn new(model: Transformer, version: u32, tokenizer: Option<Tokenizer>, cfg: EngineConfig) -> Self {
        Engine {
            kernels: Kernels::for_model(&model, cfg.cpu_kernels),
            model,
            version,
            tokenizer,
            cfg,
            waiting: VecDeque::new(),
            running: Vec::new(),
            next_id: 0,
            stats: EngineStats::default(),
        }
    }

    /// Which kernels run the model: `"cpu"` (the [CPU kernels](crate::infer)) or
    /// `"candle"` (candle ops).
    pub fn kernels(&self) -> &'static str {
        match self.kernels {
            Kernels::Cpu(_) => "cpu",
            Kernels::Candle(_) => "candle",
        }
    }

    /// The policy version now serving.
    pub fn version(&self) -> u32 {
        self.version
    }

    /// The model now serving.
    pub fn model(&self) -> &Transformer {
        &self.model
    }

    /// The tokenizer, if any.
    pub fn tokenizer(&self) -> Option<&Tokenizer> {
        self.tokenizer.as_ref()
    }

    /// What the engine did so far.
    pub fn stats(&self) -> EngineStats {
        self.stats
    }

    /// Requests waiting for admission.
    pub fn num_waiting(&self) -> usize {
        self.waiting.len()
    }

    /// Sequences in the running batch.
    pub fn num_running(&self) -> usize {
        self.running.len()
    }

    /// Whether a step would do anything.
    pub fn has_work(&self) -> bool {
        !self.waiting.is_empty() || !self.running.is_empty()
    }

    /// Queues a request; returns its id. Invalid parameters, an empty prompt or one that
    /// cannot fit the model's context are errors naming the values.
    pub fn add(&mut self, prompt: Vec<u32>, params: SamplingParams) -> Result<u64> {
        let mut problems = params.problems();
        if prompt.is_empty() {
            problems.push("prompt is empty".into());
        }
        let ctx = self.model.config().max_positions;
        if prompt.len() >= ctx {
            problems.push(format!(
                "prompt of {} tokens does not fit the model's context of {ctx}",
                prompt.len()
            ));
        }
        let vocab = self.model.config().vocab as u32;
        if let Some(t) = prompt.iter().find(|t| **t >= vocab) {
            problems.push(format!("prompt token {t} is outside the vocabulary of {vocab}"));
        }
        if prompt.len() + params.max_tokens.min(ctx) > self.cfg.max_kv_tokens {
            problems.push(format!(
                "prompt ({}) + max_tokens ({}) exceeds the engine's max_kv_tokens {}",
                prompt.len(),
                params.max_tokens,
                self.cfg.max_kv_tokens
            ));
        }
        if !problems.is_empty() {
            return Err(Error::Request(problems.join("; ")));
        }
        let id = self.next_id;
        self.next_id += 1;
        self.waiting.push_back(Seq {
            id,
            rng: StdRng::seed_from_u64(params.seed),
            prompt,
            params,
            cache: None,
            kv: None,
            tokens: Vec::new(),
            logprobs: Vec::new(),
            top_logprobs: Vec::new(),
            versions: Vec::new(),
            text_len_checked: 0,
            queued_at: now_ms(),
            started_at: 0,
        });
        Ok(id)
    }

    /// Cancels a request; its output (tokens so far) comes back from the next step with
    /// `finish_reason = cancelled`. Returns whether it was known.
    pub fn cancel(&mut self, id: u64) -> Option<Output> {
        if let Some(i) = self.waiting.iter().position(|s| s.id == id) {
            let s = self.waiting.remove(i)?;
            return Some(self.finish(s, FinishReason::Cancelled));
        }
        let i = self.running.iter().position(|s| s.id == id)?;
        let s = self.running.remove(i);
        if let Kernels::Candle(batch) = &mut self.kernels {
            let keep: Vec<u32> = (0..batch.rows() as u32).filter(|r| *r as usize != i).collect();
            if let Err(e) = batch.keep(&keep) {
                // Cannot happen for in-range rows; never leave rows and sequences out of step.
                panic!("dropping row {i} of the batch cache: {e}");
            }
        }
        Some(self.finish(s, FinishReason::Cancelled))
    }

    /// Replaces the weights between steps. The new model must have the same shape
    /// (vocabulary, layers, heads): running sequences keep their caches.
    pub fn swap(&mut self, model: Transformer, version: u32) -> Result<()> {
        let (a, b) = (self.model.config(), model.config());
        if (a.vocab, a.n_layers, a.n_kv_heads, a.head_dim, a.d_model)
            != (b.vocab, b.n_layers, b.n_kv_heads, b.head_dim, b.d_model)
        {
            return Err(Error::Shape(format!(
                "new policy version {version} has another shape (vocab {} layers {} kv heads {} head dim {} d_model {}) than the one serving (vocab {} layers {} kv heads {} head dim {} d_model {})",
                b.vocab,
                b.n_layers,
                b.n_kv_heads,
                b.head_dim,
                b.d_model,
                a.vocab,
                a.n_layers,
                a.n_kv_heads,
                a.head_dim,
                a.d_model
            )));
        }
        if let Kernels::Cpu(k) = &mut self.kernels {
            **k = CpuModel::new(&model)?;
        }
        self.model = model;
        self.version = version;
        self.stats.swaps += 1;
        Ok(())
    }

    /// Loads a checkpoint directory as policy `version`, checking its weights' SHA-256
    /// when given. On any failure the old weights keep serving and the error says why.
    pub fn load_weights(&mut self, dir: &Path, version: u32, sha256: Option<&str>) -> Result<()> {
        if let Some(want) = sha256 {
            let got = checkpoint::weights_sha256(dir)?;
            if got != want {
                return Err(Error::Checkpoint {
                    path: dir.display().to_string(),
                    reason: format!("checksum mismatch for policy version {version}: expected {want}, found {got}"),
                });
            }
        }
        let loaded = checkpoint::load_as(dir, self.model.device(), self.model.dtype())?;
        self.swap(loaded.model, version)
    }

    /// Scores a prompt with the current weights: for each token after the first, its
    /// logprob given the tokens before it (temperature 1) and the `top` most likely
    /// tokens at that position. This is the `echo` + `logprobs` of the completions API.
    pub fn prompt_logprobs(&self, prompt: &[u32], top: usize) -> Result<PromptScores> {
        let cfg = self.model.config();
        let mut problems = Vec::new();
        if prompt.len() > cfg.max_positions {
            problems.push(format!(
                "prompt of {} tokens does not fit the model's context of {}",
                prompt.len(),
                cfg.max_positions
            ));
        }
        if let Some(t) = prompt.iter().find(|t| **t as usize >= cfg.vocab) {
            problems.push(format!("prompt token {t} is outside the vocabulary of {}", cfg.vocab));
        }
        if top > MAX_TOP_LOGPROBS {
            problems.push(format!(
                "asked for {top} alternatives per token; at most {MAX_TOP_LOGPROBS}"
            ));
        }
        if !problems.is_empty() {
            return Err(Error::Request(problems.join("; ")));
        }
        if prompt.len() < 2 {
            return Ok(Vec::new());
        }
        let packed = crate::model::Packed::new(&[vec![prompt.to_vec()]], self.model.device())?;
        let (logits, _) = self.model.forward(&packed)?;
        let rows = logits.squeeze(0)?.to_vec2::<f32>()?;
        Ok(rows[..prompt.len() - 1]
            .iter()
            .zip(&prompt[1..])
            .map(|(row, &tok)| {
                let max = row.iter().copied().fold(f32::NEG_INFINITY, f32::max);
                let log_z = row.iter().map(|l| (l - max).exp()).sum::<f32>().ln();
                let logprob = |i: usize| row[i] - max - log_z;
                (logprob(tok as usize), top_n(row, top, logprob))
            })
            .collect())
    }

    /// Steps until every request has finished; returns the outputs in finishing order.
    pub fn run_to_completion(&mut self) -> Result<Vec<Output>> {
        let mut out = Vec::new();
        while self.has_work() {
            for e in self.step()? {
                if let Event::Done(o) = e {
                    out.push(o);
                }
            }
        }
        Ok(out)
    }

    /// One scheduler step: admit + prefill newcomers, one decode step for the others,
    /// retire the finished.
    pub fn step(&mut self) -> Result<Vec<Event>> {
        let mut events = Vec::new();
        self.stats.steps += 1;
        if matches!(self.kernels, Kernels::Cpu(_)) {
            self.step_cpu(&mut events)?;
            return Ok(events);
        }
        // Decode first for the sequences already running, then admit: a newcomer's first
        // token comes from its prefill, so it joins the decode batch from the next step.
        if !self.running.is_empty() {
            self.decode(&mut events)?;
        }
        let admitted = self.admit();
        if !admitted.is_empty() {
            self.prefill(admitted, &mut events)?;
        }
        Ok(events)
    }

    /// One step on the CPU kernels: the running sequences' newest tokens and the
    /// newcomers' prompts go through one forward; every one of them gets its next token.
    fn step_cpu(&mut self, events: &mut Vec<Event>) -> Result<()> {
        let admitted = self.admit();
        let Kernels::Cpu(cpu) = &self.kernels else {
            unreachable!("step_cpu runs on the CPU kernels")
        };
        let mut seqs = std::mem::take(&mut self.running);
        let decoding = seqs.len();
        let started = now_ms();
        let ctx = self.model.config().max_positions;
        for mut s in admitted {
            s.kv = Some(cpu.new_kv(s.budget().min(ctx)));
            s.started_at = started;
            seqs.push(s);
        }
        if seqs.is_empty() {
            return Ok(());
        }
        let logits = {
            let mut entries: Vec<(&mut SeqKv, &[u32])> = seqs
                .iter_mut()
                .map(|s| {
                    let Seq { kv, prompt, tokens, .. } = s;
                    let new: &[u32] = match tokens.last() {
                        Some(t) => std::slice::from_ref(t),
                        None => prompt,
                    };
                    (kv.as_mut().expect("CPU sequences have a cache"), new)
                })
                .collect();
            cpu.forward(&mut entries)
        };
        let logits = match logits {
            Ok(l) => l,
            Err(e) => {
                // Nothing was cached (the kernels check before they write): put everyone back.
                let newcomers = seqs.split_off(decoding);
                self.running = seqs;
                for mut s in newcomers.into_iter().rev() {
                    s.kv = None;
                    self.waiting.push_front(s);
                }
                return Err(e);
            }
        };
        self.stats.prefilled += seqs[decoding..].iter().map(|s| s.prompt.len() as u64).sum::<u64>();
        if decoding > 0 {
            self.stats.decode_steps += 1;
            self.stats.batch_rows += decoding as u64;
        }
        let v = self.model.config().vocab;
        let rows = logits.chunks_exact(v).map(<[f32]>::to_vec).collect();
        self.running = self.advance(seqs, rows, events)?.into_iter().map(|(_, s)| s).collect();
        Ok(())
    }

    fn admit(&mut self) -> Vec<Seq> {
        // On candle a prefill is a forward pass of its own: with sequences running, wait
        // until enough slots are free to amortise it over several newcomers (or nothing
        // else is waiting to fill them anyway).
        let free = self.cfg.max_num_seqs.saturating_sub(self.running.len());
        let min_batch = match self.kernels {
            Kernels::Cpu(_) => 1,
            Kernels::Candle(_) => self.cfg.min_prefill_batch.clamp(1, self.cfg.max_num_seqs),
        };
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

    fn prefill(&mut self, mut seqs: Vec<Seq>, events: &mut Vec<Event>) -> Result<()> {
        let dev = self.model.device().clone();
        let b = seqs.len();
        let t = seqs.iter().map(|s| s.prompt.len()).max().unwrap_or(1);
        let mut tokens = vec![0u32; b * t];
        let mut positions = vec![0u32; b * t];
        let mut mask = vec![MASKED; b * t * t];
        let lens: Vec<usize> = seqs.iter().map(|s| s.prompt.len()).collect();
        for (r, s) in seqs.iter().enumerate() {
            for (i, &tok) in s.prompt.iter().enumerate() {
                tokens[r * t + i] = tok;
                positions[r * t + i] = i as u32;
            }
            for i in 0..t {
                for j in 0..=i.min(lens[r] - 1) {
                    mask[(r * t + i) * t + j] = 0.0;
                }
            }
        }
        let ctx = self.model.config().max_positions;
        let mut caches: Vec<KvCache> = seqs.iter().map(|s| self.model.new_cache(s.budget().min(ctx))).collect();
        let mut refs: Vec<&mut KvCache> = caches.iter_mut().collect();
        let logits = self.model.forward_ragged(
            &Tensor::from_vec(tokens, (b, t), &dev)?,
            &Tensor::from_vec(positions, (b, t), &dev)?,
            &Tensor::from_vec(mask, (b, 1, t, t), &dev)?,
            &mut refs,
            &lens,
        )?;
        let idx = Tensor::from_vec(
            lens.iter()
                .enumerate()
                .map(|(r, l)| (r * t + l - 1) as u32)
                .collect::<Vec<_>>(),
            b,
            &dev,
        )?;
        let v = self.model.config().vocab;
        let last = logits.reshape((b * t, v))?.index_select(&idx, 0)?.to_vec2::<f32>()?;
        let started = now_ms();
        self.stats.prefilled += lens.iter().sum::<usize>() as u64;
        for (s, c) in seqs.iter_mut().zip(caches) {
            s.cache = Some(c);
            s.started_at = started;
        }
        let mut joined = self.advance(seqs, last, events)?;
        let cap = self
            .running
            .iter()
            .chain(joined.iter().map(|(_, s)| s))
            .map(|s| s.budget().min(ctx))
            .max()
            .unwrap_or(1);
        {
            let caches: Vec<&KvCache> = joined
                .iter()
                .map(|(_, s)| s.cache.as_ref().expect("prefilled sequences have a cache"))
                .collect();
            let Kernels::Candle(batch) = &mut self.kernels else {
                unreachable!("prefill runs on candle")
            };
            batch.push(&caches, cap)?;
        }
        for (_, s) in joined.iter_mut() {
            s.cache = None;
        }
        self.running.extend(joined.into_iter().map(|(_, s)| s));
        Ok(())
    }

    fn decode(&mut self, events: &mut Vec<Event>) -> Result<()> {
        let dev = self.model.device().clone();
        let seqs = std::mem::take(&mut self.running);
        let b = seqs.len();
        // Row r's newest token sits at position prompt + generated − 1; its keys and values
        // are written there now.
        let positions: Vec<u32> = seqs
            .iter()
            .map(|s| (s.prompt.len() + s.tokens.len() - 1) as u32)
            .collect();
        let width = positions.iter().map(|p| *p as usize + 1).max().unwrap_or(1);
        let tokens: Vec<u32> = seqs
            .iter()
            .map(|s| *s.tokens.last().expect("running sequences have a token"))
            .collect();
        let mut mask = vec![MASKED; b * width];
        for (r, p) in positions.iter().enumerate() {
            mask[r * width..r * width + *p as usize + 1].fill(0.0);
        }
        let Kernels::Candle(batch) = &mut self.kernels else {
            unreachable!("decode runs on candle")
        };
        let logits = self.model.forward_batched(
            &Tensor::from_vec(tokens, (b, 1), &dev)?,
            &Tensor::from_vec(positions, (b, 1), &dev)?,
            &Tensor::from_vec(mask, (b, 1, 1, width), &dev)?,
            batch,
            width,
        )?;
        let rows = logits.squeeze(1)?.to_vec2::<f32>()?;
        self.stats.decode_steps += 1;
        self.stats.batch_rows += b as u64;
        let kept = self.advance(seqs, rows, events)?;
        let idx: Vec<u32> = kept.iter().map(|(r, _)| *r as u32).collect();
        if let Kernels::Candle(batch) = &mut self.kernels {
            batch.keep(&idx)?;
        }
        self.running = kept.into_iter().map(|(_, s)| s).collect();
        Ok(())
    }

    /// Samples one token per sequence from its logits row, records it, and retires the
    /// sequences that finished.
    /// Returns the sequences still running, with their index in `seqs`.
    fn advance(&mut self, seqs: Vec<Seq>, rows: Vec<Vec<f32>>, events: &mut Vec<Event>) -> Result<Vec<(usize, Seq)>> {
        let ctx = self.model.config().max_positions;
        let eos = self.tokenizer.as_ref().and_then(|t| t.eos);
        let mut kept = Vec::with_capacity(seqs.len());
        for (r, (mut s, row)) in seqs.into_iter().zip(rows).enumerate() {
            let (token, logprob, top) = sample(&row, &s.params, &mut s.rng);
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

    fn finish(&mut self, s: Seq, reason: FinishReason) -> Output {
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
        Output {
            id: s.id,
            prompt_len: s.prompt.len(),
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

/// The `n` most likely tokens of a logits row (most likely first, ties by lower id) with
/// `logprob` of each.
pub fn top_n(logits: &[f32], n: usize, logprob: impl Fn(usize) -> f32) -> Vec<(u32, f32)> {
    if n == 0 || logits.is_empty() {
        return Vec::new();
    }
    let order = |a: &usize, b: &usize| logits[*b].total_cmp(&logits[*a]).then(a.cmp(b));
    let mut idx: Vec<usize> = (0..logits.len()).collect();
    let n = n.min(idx.len());
    if n < idx.len() {
        idx.select_nth_unstable_by(n - 1, order);
        idx.truncate(n);
    }
    idx.sort_unstable_by(order);
    idx.into_iter().map(|i| (i as u32, logprob(i))).collect()
}

/// Picks a token from one row of logits: its logprob is under the temperature-scaled
/// distribution over the full vocabulary; top-k and top-p only restrict which tokens can
/// be drawn. Also returns the `p.logprobs` most likely tokens under that distribution.
fn sample(logits: &[f32], p: &SamplingParams, rng: &mut StdRng) -> (u32, f32, Vec<(u32, f32)>) {
    let t = if p.temperature > 0.0 { p.temperature } else { 1.0 };
    let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    // log_softmax(l / t) = (l - max) / t - log Σ exp((l - max) / t)
    let e: Vec<f32> = logits.iter().map(|l| ((l - max) / t).exp()).collect();
    let z: f32 = e.iter().sum();
    let log_z = z.ln();
    let logprob = |i: usize| (logits[i] - max) / t - log_z;
    let top = top_n(logits, p.logprobs, logprob);
    if p.temperature == 0.0 {
        let (i, _) = logits.iter().enumerate().fold(
            (0, f32::NEG_INFINITY),
            |acc, (i, &l)| if l > acc.1 { (i, l) } else { acc },
        );
        return (i as u32, logprob(i), top);
    }
    let mut cand: Vec<(usize, f32)> = e.iter().enumerate().map(|(i, &v)| (i, v / z)).collect();
    if p.top_k > 0 || p.top_p < 1.0 {
        cand.sort_by(|a, b| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0)));
        if p.top_k > 0 {
            cand.truncate(p.top_k);
        }
        if p.top_p < 1.0 {
            let mut acc = 0.0;
            let mut keep = cand.len();
            for (n, (_, q)) in cand.iter().enumerate() {
                acc += q;
                if acc >= p.top_p {
                    keep = n + 1;
                    break;
                }
            }
            cand.truncate(keep);
        }
    }
    let total: f32 = cand.iter().map(|c| c.1).sum();
    let u: f32 = rng.random::<f32>() * total;
    let mut acc = 0.0;
    for &(i, q) in &cand {
        acc += q;
        if u < acc {
            return (i as u32, logprob(i), top);
        }
    }
    let i = cand.last().map_or(0, |c| c.0);
    (i as u32, logprob(i), top)
}
