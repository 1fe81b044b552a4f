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
//! ([`BatchKv`](crate::model::BatchKv)) as rows; a decode step writes every row's new keys and values with one
//! scatter.
//!
//! Every generated token carries its logprob under the temperature-scaled distribution
//! (`log_softmax(logits / T)`, full vocabulary, before top-k/top-p truncation; greedy
//! reports T = 1) and the policy version that produced it. [`Engine::swap`] and
//! [`Engine::load_weights`] replace the weights *between* steps without touching running
//! sequences: their next tokens come from the new weights and carry the new version. The
//! slow part of a swap can run beside decoding: a [`WeightLoader`] (from
//! [`Engine::loader`]) prepares a version on another thread, and [`Engine::install`]
//! swaps it in (a move). [`Engine::hold_admissions`] keeps waiting requests out of the
//! batch meanwhile, so that they start on the version being prepared.
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

use rand::SeedableRng;
use rand::rngs::StdRng;

use crate::infer::CpuModel;
use crate::{Error, Result, Tokenizer, Transformer, checkpoint};

mod candle;
mod core;
mod cpu;
mod params;
mod sample;

use candle::CandleStep;
use core::{Core, Seq, now_ms};
use cpu::CpuStep;
pub use params::{
    EngineConfig, EngineStats, Event, FinishReason, MAX_TOP_LOGPROBS, Output, PromptScores, SamplingParams,
};
pub use sample::top_n;

/// How a step turns sequences into next-token logits: the [CPU kernels](crate::infer)
/// ([`CpuStep`]) or candle ops on any device ([`CandleStep`]). The scheduler's state and
/// its bookkeeping (admission, sampling, retiring) are the [`Core`]'s; a backend owns only
/// the key/value state its forwards need.
trait StepBackend: Send {
    /// `"cpu"` or `"candle"`.
    fn name(&self) -> &'static str;
    /// One step: admit, run the forwards, sample (with [`Core::advance`]), retire.
    fn step(&mut self, core: &mut Core, events: &mut Vec<Event>) -> Result<()>;
    /// Running sequence `row` was cancelled: its keys and values go.
    fn drop_row(&mut self, row: usize) -> Result<()>;
    /// The weights are now `model` (same shape as before); `layout` is `model` already in
    /// this backend's own layout when a [`WeightLoader`] built it off the decode path.
    /// Returns the old layout, if the backend had one, for the caller to free.
    fn swap(&mut self, model: &Transformer, layout: Option<Box<CpuModel>>) -> Result<Option<Box<CpuModel>>>;
}

/// A policy version read, checked and laid out for an engine's kernels, ready for
/// [`Engine::install`]: the slow part of a weight swap (hashing, reading, transposing
/// into the CPU kernels' layout), done by a [`WeightLoader`] on any thread while the
/// engine keeps decoding.
pub struct Prepared {
    model: Transformer,
    layout: Option<Box<CpuModel>>,
    version: u32,
}

impl Prepared {
    /// The policy version it holds.
    pub fn version(&self) -> u32 {
        self.version
    }
}

/// Loads checkpoints for one engine (its device, dtype and kernels) without borrowing it:
/// `Send` and cheap to clone, for a background thread. See [`Engine::loader`].
#[derive(Clone)]
pub struct WeightLoader {
    device: candle_core::Device,
    dtype: candle_core::DType,
    products: streamrl_kernels::bf16::Products,
    cpu_layout: bool,
}

impl WeightLoader {
    /// Loads a checkpoint directory as policy `version`, checking its weights' SHA-256
    /// when given, and lays it out for the engine's kernels.
    pub fn load(&self, dir: &Path, version: u32, sha256: Option<&str>) -> Result<Prepared> {
        // A core in use: a training step in this process spreads its products elsewhere.
        let _busy = streamrl_kernels::cores::busy();
        if let Some(want) = sha256 {
            let got = checkpoint::weights_sha256(dir)?;
            if got != want {
                return Err(Error::checkpoint(
                    dir,
                    format!("checksum mismatch for policy version {version}: expected {want}, found {got}"),
                ));
            }
        }
        let mut model = checkpoint::load_as(dir, &self.device, self.dtype)?.model;
        model.set_products(self.products);
        let layout = if self.cpu_layout {
            Some(Box::new(CpuModel::new(&model)?))
        } else {
            None
        };
        Ok(Prepared { model, layout, version })
    }
}

/// The continuous-batching engine. See the [module docs](self).
pub struct Engine {
    core: Core,
    backend: Box<dyn StepBackend>,
}

impl Engine {
    /// An engine serving `model` as policy `version`. Without a tokenizer, stop strings
    /// are not checked and `text` is empty.
    pub fn new(model: Transformer, version: u32, tokenizer: Option<Tokenizer>, cfg: EngineConfig) -> Self {
        // Asked for candle, or not f32 on the CPU: candle ops serve it.
        let backend: Box<dyn StepBackend> = match cfg.cpu_kernels.then(|| CpuModel::new(&model)) {
            Some(Ok(c)) => Box::new(CpuStep(Box::new(c))),
            _ => Box::<CandleStep>::default(),
        };
        Engine {
            core: Core {
                model,
                version,
                tokenizer,
                cfg,
                waiting: VecDeque::new(),
                running: Vec::new(),
                next_id: 0,
                stats: EngineStats::default(),
                hold: false,
            },
            backend,
        }
    }

    /// Which kernels run the model: `"cpu"` (the [CPU kernels](crate::infer)) or
    /// `"candle"` (candle ops).
    pub fn kernels(&self) -> &'static str {
        self.backend.name()
    }

    /// The policy version now serving.
    pub fn version(&self) -> u32 {
        self.core.version
    }

    /// The model now serving.
    pub fn model(&self) -> &Transformer {
        &self.core.model
    }

    /// The tokenizer, if any.
    pub fn tokenizer(&self) -> Option<&Tokenizer> {
        self.core.tokenizer.as_ref()
    }

    /// What the engine did so far.
    pub fn stats(&self) -> EngineStats {
        self.core.stats
    }

    /// Requests waiting for admission.
    pub fn num_waiting(&self) -> usize {
        self.core.waiting.len()
    }

    /// Sequences in the running batch.
    pub fn num_running(&self) -> usize {
        self.core.running.len()
    }

    /// While `hold` is true, steps admit no waiting request (running sequences go on):
    /// for requests that should start on a version still being prepared.
    pub fn hold_admissions(&mut self, hold: bool) {
        self.core.hold = hold;
    }

    /// Whether a step would do anything.
    pub fn has_work(&self) -> bool {
        !self.core.running.is_empty() || (!self.core.hold && !self.core.waiting.is_empty())
    }

    /// Queues a request; returns its id. Invalid parameters, an empty prompt or one that
    /// cannot fit the model's context are errors naming the values.
    pub fn add(&mut self, prompt: Vec<u32>, params: SamplingParams) -> Result<u64> {
        let mut problems = params.problems();
        if prompt.is_empty() {
            problems.push("prompt is empty".into());
        }
        let ctx = self.core.model.config().max_positions;
        if prompt.len() >= ctx {
            problems.push(format!(
                "prompt of {} tokens does not fit the model's context of {ctx}",
                prompt.len()
            ));
        }
        let vocab = self.core.model.config().vocab as u32;
        if let Some(t) = prompt.iter().find(|t| **t >= vocab) {
            problems.push(format!("prompt token {t} is outside the vocabulary of {vocab}"));
        }
        if prompt.len() + params.max_tokens.min(ctx) > self.core.cfg.max_kv_tokens {
            problems.push(format!(
                "prompt ({}) + max_tokens ({}) exceeds the engine's max_kv_tokens {}",
                prompt.len(),
                params.max_tokens,
                self.core.cfg.max_kv_tokens
            ));
        }
        if !problems.is_empty() {
            return Err(Error::Request(problems.join("; ")));
        }
        let id = self.core.next_id;
        self.core.next_id += 1;
        self.core.waiting.push_back(Seq {
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
        if let Some(i) = self.core.waiting.iter().position(|s| s.id == id) {
            let s = self.core.waiting.remove(i)?;
            return Some(self.core.finish(s, FinishReason::Cancelled));
        }
        let i = self.core.running.iter().position(|s| s.id == id)?;
        let s = self.core.running.remove(i);
        if let Err(e) = self.backend.drop_row(i) {
            // Cannot happen for in-range rows; never leave rows and sequences out of step.
            panic!("dropping row {i} of the batch cache: {e}");
        }
        Some(self.core.finish(s, FinishReason::Cancelled))
    }

    /// Replaces the weights between steps. The new model must have the same shape
    /// (vocabulary, layers, heads): running sequences keep their caches.
    pub fn swap(&mut self, model: Transformer, version: u32) -> Result<()> {
        self.install(Prepared {
            model,
            layout: None,
            version,
        })
    }

    /// A loader for this engine's device, dtype and kernels, to prepare the next version
    /// on another thread while this one decodes.
    pub fn loader(&self) -> WeightLoader {
        WeightLoader {
            device: self.core.model.device().clone(),
            dtype: self.core.model.dtype(),
            products: self.core.model.products(),
            cpu_layout: self.backend.name() == "cpu",
        }
    }

    /// Swaps in prepared weights between steps (a move, no copy, when they were prepared
    /// by this engine's [`loader`](Self::loader)); the same shape rules as [`swap`](Self::swap).
    pub fn install(&mut self, prepared: Prepared) -> Result<()> {
        let Prepared { model, layout, version } = prepared;
        let (a, b) = (self.core.model.config(), model.config());
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
        let old_layout = self.backend.swap(&model, layout)?;
        let old_model = std::mem::replace(&mut self.core.model, model);
        // Freeing the old weights (over a GB at 135M parameters: the model and its CPU
        // layout) takes tens of ms: not on the decode path.
        let old = (old_model, old_layout);
        // (Without a thread to spare, spawn drops the closure, and the weights, here.)
        let _ = std::thread::Builder::new()
            .name("free-weights".into())
            .spawn(move || drop(old));
        self.core.version = version;
        self.core.stats.swaps += 1;
        Ok(())
    }

    /// Loads a checkpoint directory as policy `version`, checking its weights' SHA-256
    /// when given. On any failure the old weights keep serving and the error says why.
    /// ([`loader`](Self::loader) then [`install`](Self::install), on this thread.)
    pub fn load_weights(&mut self, dir: &Path, version: u32, sha256: Option<&str>) -> Result<()> {
        let prepared = self.loader().load(dir, version, sha256)?;
        self.install(prepared)
    }

    /// Scores a prompt with the current weights: for each token after the first, its
    /// logprob given the tokens before it (temperature 1) and the `top` most likely
    /// tokens at that position. This is the `echo` + `logprobs` of the completions API.
    pub fn prompt_logprobs(&self, prompt: &[u32], top: usize) -> Result<PromptScores> {
        let cfg = self.core.model.config();
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
        let packed = crate::model::Packed::new(&[vec![prompt.to_vec()]], self.core.model.device())?;
        let (logits, _) = self.core.model.forward(&packed)?;
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

    /// One scheduler step: admit and prefill newcomers, one decode step for the running
    /// sequences, retire the finished (in the order the backend needs).
    pub fn step(&mut self) -> Result<Vec<Event>> {
        // A core in use: a training step in this process spreads its products elsewhere.
        let _busy = streamrl_kernels::cores::busy();
        let mut events = Vec::new();
        self.core.stats.steps += 1;
        self.backend.step(&mut self.core, &mut events)?;
        Ok(events)
    }
}
